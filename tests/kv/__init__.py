"""Tests of the KV cache: pages, the KV SDK in process and over HTTP, the KV tiers."""
