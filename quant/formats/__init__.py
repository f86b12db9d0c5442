"""Quantized formats: one QuantLinear base with a registry, and each format the kernels run."""

# Importing the format modules registers them in base.FORMATS, so that anything reading
# a checkpoint finds every format by name.
from . import int4, int5, int6, int8, iq4xs, lut, q2k, q3k, q4k, q5k  # noqa: F401
