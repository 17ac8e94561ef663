"""`python -m serve_app.cli`: the `serve-app` console script."""

from serve_app.cli import main

main()
