"""Tests of the app as users run it: serve run, a two-raylet cluster, a killed replica, a soak."""
