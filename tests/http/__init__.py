"""Tests of the HTTP APIs in process, with the official SDKs and agent frameworks, and the web page."""
