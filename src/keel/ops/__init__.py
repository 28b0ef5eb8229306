"""Compute kernels written for Keel in plain PyTorch: pieces of a training step that the model calls."""
