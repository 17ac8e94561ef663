"""The engine: `InferenceEngine` and its scheduler, tasks, sampling and stop rules; the engine's own
process (`process.EngineProcess` on the host side, `child` inside it) and the typed messages
between the two (`messages`); the serving boundary the HTTP layer and Serve reach it through
(`serving`)."""
