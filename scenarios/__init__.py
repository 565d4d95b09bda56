"""Bundled scenario files (TOML) and the real request traces they use (`traces/`)."""
