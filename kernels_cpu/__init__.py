"""CPU kernels for the quantized formats, in three layers:

reference.py  the torch definition of each kernel
csrc/         C11: a scalar path and SIMD paths chosen at run time, a thread pool,
              and the CPython module (built by setup.py as `_C`)
ops.py        the binding: checks shapes and dtypes, picks path and threads, falls
              back to the reference (with one warning) when `_C` is not built
"""
