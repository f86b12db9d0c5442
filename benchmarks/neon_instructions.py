"""Instructions the AArch64 matmuls of the super-block kinds execute per block of 256
weights and row of x, on the scalar path, plain NEON and neondot, counted under qemu (no
Arm host is needed, none is timed: a count is not a time).

    python benchmarks/neon_instructions.py

native/neon_gemv.c is cross-compiled with the extension's flags and run under
`qemu-aarch64 -cpu max -singlestep -d exec` (one log line a guest instruction). A GEMV
(M = 1) and a prompt's GEMM (M = 32) of K = 4096 on one thread: the count over 9 rows of
W less over 1, less the setup's difference, over the 8 rows' 128 blocks and M rows of x.
Needs aarch64-linux-gnu-gcc and qemu-aarch64.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "kernels_cpu" / "csrc"
FILES = ("pool", "cpu", "scalar", "neon", "matmul", "igemm", "igemm_neon", "q4k_q5k", "q2k_q3k")
FILES += ("iq4xs",)
KINDS = {"Q4_K": 12, "Q5_K": 13, "Q6_K (int6)": 6, "Q3_K": 11, "Q2_K": 10, "IQ4_XS": 23}
PATHS = {"scalar C": 0, "plain NEON": 5, "neondot": 6}  # kernels.h's isa numbers
BLOCKS = 8 * 4096 // 256  # the 8 rows' blocks between the two runs


def build(out: Path) -> None:
    flags = ["-O3", "-std=c11", "-ffp-contract=off", "-pthread", "-DINFER_NO_PYTHON"]
    sources = [ROOT / "benchmarks" / "native" / "neon_gemv.c"]
    sources += [CSRC / f"{f}.c" for f in FILES]
    cmd = ["aarch64-linux-gnu-gcc", *flags, f"-I{CSRC}", *map(str, sources), "-lm"]
    subprocess.run([*cmd, "-o", str(out)], check=True)


def count(binary: Path, log: Path, *args: object) -> int:
    cmd = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", "-cpu", "max", "-singlestep"]
    cmd += ["-d", "exec,nochain", "-D", str(log), str(binary), *map(str, args)]
    subprocess.run(cmd, check=True, capture_output=True)
    with log.open() as f:
        return sum(line.startswith("Trace") for line in f)


def per_block(binary: Path, log: Path, isa: int, kind: int, m: int) -> int:
    """Instructions a block of 256 weights and row of x."""
    setup = count(binary, log, 0, kind, 9, m, "skip") - count(binary, log, 0, kind, 1, m, "skip")
    matmul = count(binary, log, isa, kind, 9, m) - count(binary, log, isa, kind, 1, m)
    return (matmul - setup) // (BLOCKS * m)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        binary, log = Path(tmp) / "neon_gemv", Path(tmp) / "exec.log"
        build(binary)
        for m, what in ((1, "GEMV (decode)"), (32, "GEMM of 32 rows (prompts)")):
            print(f"\n{what}: instructions a block of 256 weights and row of x\n")
            print("| kind | " + " | ".join(PATHS) + " |")
            print("| --- |" + " ---: |" * len(PATHS))
            for name, kind in KINDS.items():
                cells = [f"{per_block(binary, log, isa, kind, m):,}" for isa in PATHS.values()]
                print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
