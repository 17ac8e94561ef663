"""The routers: generation (OpenAI and Anthropic), cached KV, admin (health, models, stats, metrics) and the web page."""
