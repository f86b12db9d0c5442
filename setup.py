"""Build of the C kernels (kernels_cpu/csrc) as infer.kernels_cpu._C.

Everything else about the package is in pyproject.toml. The extension is plain C11
against CPython's API only (not PyTorch's), so the build needs no torch. Every
instruction-set path is compiled into the one shared object through per-function
target attributes and chosen at run time: never -march=native, so a wheel built here
runs on any x86-64 (or AArch64) CPU.
"""

import sys
from glob import glob

from setuptools import Extension, setup

if sys.platform == "win32":
    ext_modules = []  # pthreads and GNU attributes: the kernels build with gcc or clang
else:
    ext_modules = [
        Extension(
            "infer.kernels_cpu._C",
            # Every C file in csrc/, so other kernel files join the same extension.
            sources=sorted(glob("kernels_cpu/csrc/*.c")),
            depends=sorted(glob("kernels_cpu/csrc/*.h")),
            extra_compile_args=[
                "-O3",
                "-std=c11",
                # a * b + c stays two roundings unless a kernel asks for an FMA, so the
                # dequantization matches the formats' definitions bit for bit.
                "-ffp-contract=off",
                # Python's CFLAGS carry -fwrapv (signed overflow defined, for CPython's own
                # code); it keeps gcc from simplifying the kernels' index arithmetic, and
                # made the int8 GEMV 15-30 % slower. The kernels never overflow a signed int.
                "-fno-wrapv",
                "-fvisibility=hidden",
                "-pthread",
            ],
            extra_link_args=["-pthread"],
        )
    ]

setup(ext_modules=ext_modules)
