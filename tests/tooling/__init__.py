"""Tests of the CLI, the benchmarks, the app's config, the deployment files and the layering rules."""
