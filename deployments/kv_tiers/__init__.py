"""The KV tiers Ray holds: a node's page store (a Ray actor), the host and cluster tiers an engine reaches
it by, and the bench that times them on a cluster of two raylets."""
