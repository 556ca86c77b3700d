"""Triton kernels (flashpage.kernels.triton_ops) and their PyTorch references (flashpage.kernels.reference)."""
