"""The NEON paths against the scalar ones, on an x86 machine.

Each harness in tests/native is cross-compiled for AArch64 (no Python in it) and run under
qemu-aarch64, on a CPU with dotprod (max) and one without (cortex-a53), so both dispatch
levels run:
- lut_neon_check.c: the LUT-GEMV (kernels_cpu/csrc/lut_neon.c through lut.c) equals the
  scalar path bit for bit; awkward shapes (M 1 and 7, K % 256 != 0, odd N, bits 1..4, g 8..128).
- q_neon_check.c: the int8, int4, int5, int6 and super-block kinds' matmuls (neon.c,
  q4k_q5k.c, q2k_q3k.c, iq4xs.c, igemm_neon.c through matmul.c) equal the scalar path up
  to float summation order and, in the digit GEMVs and neondot's integer GEMM, x's two
  digits; M 1, 3, 7, 12, 16, 41, odd N, K = 32 x odd; 1 and 2 threads give the same bits,
  and neon (sdot emulated) neondot's where both run one algorithm.
Skipped where the cross tools are missing; on an AArch64 machine test_kernels_lut.py and
test_kernels_q.py run the NEON paths natively.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "kernels_cpu" / "csrc"
CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian / Ubuntu's cross libc
# harness -> the kernel files it links
HARNESSES = {
    "lut_neon_check": (
        "pool",
        "cpu",
        "scalar",
        "neon",
        "igemm_neon",
        "lut",
        "lut_scalar",
        "lut_neon",
    ),
    "q_neon_check": (
        "pool",
        "cpu",
        "scalar",
        "neon",
        "matmul",
        "igemm",
        "igemm_neon",
        "q4k_q5k",
        "q2k_q3k",
        "iq4xs",
    ),
}

pytestmark = pytest.mark.slow  # a cross compile and an emulated CPU per case


@pytest.fixture(scope="module", params=list(HARNESSES))
def binary(request, tmp_path_factory) -> Path:
    missing = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)} to cross-check the NEON path")
    out = tmp_path_factory.mktemp("neon") / request.param
    sources = [ROOT / "tests" / "native" / f"{request.param}.c"]
    sources += [CSRC / f"{f}.c" for f in HARNESSES[request.param]]
    # the extension's flags (setup.py), no Python; the kernels choose dotprod at run time
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-DINFER_NO_PYTHON"]
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


def test_sdot_is_inlined_into_the_dot_kernels(binary):
    """kernels.h's sdot (neon_sdot_insn) is not always_inline, as the kernels' bodies
    compile for both paths: each neondot kernel must still have it inlined, one sdot
    instruction, never a call."""
    nm = shutil.which(CC.replace("gcc", "nm"))
    if nm is None:
        pytest.skip("needs the cross binutils' nm")
    symbols = subprocess.run([nm, str(binary)], check=True, capture_output=True, text=True)
    assert "neon_sdot_insn" not in symbols.stdout
