"""Offline batches: OpenAI's batch file format, answering its lines, the results file."""
