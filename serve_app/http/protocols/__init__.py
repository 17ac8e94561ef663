"""One `ResponseBuilder` per API (OpenAI chat and legacy completions, Anthropic Messages), their
errors and limits, and the `/v1/kv` wire format."""
