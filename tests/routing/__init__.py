"""Tests of routing by cached pages: the policy without Ray, and two replicas behind serve run."""
