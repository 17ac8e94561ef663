"""The Ray Serve deployments: thin wrappers that host serve_app's engine and HTTP API."""
