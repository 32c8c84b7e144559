"""Lying engines: wrappers of the reference engine that `qualify run` runs via QUALIFY_ENGINE_MODULE."""
