"""The NEON LUT-GEMV path (kernels_cpu/csrc/lut.c) equals the scalar one bit for bit.

On an x86 machine: tests/native/lut_neon_check.c is cross-compiled for AArch64 (no Python
in it) and run under qemu-aarch64, on a CPU with dotprod (max) and one without
(cortex-a53), so both dispatch levels run. Awkward shapes (M 1 and 7, K % 256 != 0, odd N,
bits 1..4, g 8..128) are in the C file. Skipped where the cross tools are missing; on an
AArch64 machine test_kernels_lut.py runs the NEON path natively.
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
    out = tmp_path_factory.mktemp("neon") / "lut_neon_check"
    sources = [ROOT / "tests" / "native" / "lut_neon_check.c"]
    sources += [CSRC / f for f in ("pool.c", "cpu.c", "scalar.c", "neon.c")]
    # the extension's flags (setup.py), no Python; the kernels choose dotprod at run time
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-DINFER_NO_PYTHON"]
    cmd = [CC, *flags, f"-I{CSRC}", *map(str, sources), "-lm", "-o", str(out)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.parametrize("cpu,dotprod", [("max", 1), ("cortex-a53", 0)])
def test_neon_equals_scalar(binary, cpu, dotprod):
    cmd = [QEMU, "-cpu", cpu]
    if SYSROOT.is_dir():
        cmd += ["-L", str(SYSROOT)]
    r = subprocess.run(
        [*cmd, str(binary)], check=False, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"dotprod={dotprod} " in r.stdout, r.stdout  # the CPU gave the level asked for
