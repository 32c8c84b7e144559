"""GPU kernels for the engine's linear-attention layers; knows nothing of qualify."""
