"""Command-line tooling: patch an installed lmdeploy in place and maintain the patch series."""
