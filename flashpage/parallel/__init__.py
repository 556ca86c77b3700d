"""Tensor parallelism: the group and its collectives (`group`), the ranks' processes (`workers`)."""
