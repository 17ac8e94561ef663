"""Offline batches on Ray Data: `serve-app batch`'s pipeline and its pool of engine actors."""
