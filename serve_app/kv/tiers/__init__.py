"""Tiers behind the page pool: this node's host store, page files on disk, and other nodes' host stores."""
