"""The types that cross a boundary (HTTP layer to engine, host to engine process, ingress to replica over Ray, KV
SDK to server, engine to router): requests, outputs, refusals, calls, the model's card, page events. The ground
floor: it imports nothing else of the project, and loads no torch and no Ray."""
