"""Routing requests among engine replicas by the pages they cache: the directory the replicas report
to, each router's index of it, and the policy that ranks replicas. No Ray and no torch here: the Ray
glue is `deployments.router`, and `serve-app bench route --simulate` runs this code without a model."""
