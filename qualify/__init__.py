"""qualify: boot an inference-engine build, prove it behaves as qualified, and store a signed receipt."""

__version__ = "0.1.0"
