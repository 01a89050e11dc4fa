"""The lmdeploy patch series, shipped inside the wheel as package data."""
