"""The routers: generation (OpenAI and Anthropic), cached KV, and admin (health, models, stats, metrics)."""
