"""Lying engines: small wrappers that patch the reference engine, run as QUALIFY_ENGINE_MODULE through the
real `qualify run` path, each getting one thing wrong that a check must catch."""
