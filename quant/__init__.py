"""Quantized formats (see issue 3)."""
