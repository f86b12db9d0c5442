"""CPU kernels (see issue 4)."""
