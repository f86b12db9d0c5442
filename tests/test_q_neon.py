"""The NEON int8 and int4 matmuls (kernels_cpu/csrc/neon.c) against the scalar path.

On an x86 machine: tests/native/q_neon_check.c is cross-compiled for AArch64 with the
kernels' drivers (no Python in it) and run under qemu-aarch64, on a CPU with dotprod (max:
neondot's int4 GEMV on x's two digits) and one without (cortex-a53: the float paths).
Shapes and bounds are in the C file. Skipped where the cross tools are missing; on an
AArch64 machine test_kernels_q.py runs the NEON paths natively.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "kernels_cpu" / "csrc"
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian / Ubuntu's cross libc


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    missing = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} to cross-check the NEON path")
    out = tmp_path_factory.mktemp("neon") / "q_neon_check"
    sources = [ROOT / "tests" / "native" / "q_neon_check.c"]
    sources += [CSRC / f"{f}.c" for f in ("pool", "cpu", "scalar", "neon", "matmul", "igemm")]
    # the extension's flags (setup.py); the kernels choose dotprod at run time
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread"]
    cmd = [CC, *flags, f"-I{CSRC}", *map(str, sources), "-lm", "-o", str(out)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("cpu,dotprod", [("max", 1), ("cortex-a53", 0)])
def test_neon_matches_scalar(binary, cpu, dotprod):
    cmd = [QEMU, "-cpu", cpu]
    if SYSROOT.is_dir():
        cmd += ["-L", str(SYSROOT)]
    r = subprocess.run(
        [*cmd, str(binary)], check=False, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"dotprod={dotprod} " in r.stdout, r.stdout  # the CPU gave the level asked for
