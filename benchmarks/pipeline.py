"""A model's layers over `infer worker` processes on loopback against one process: decode
tok/s and TTFT of one greedy answer, or with --serve the aggregate decode of concurrent
streams through `infer serve --workers` (benchmarks/serve_batch.py measures it).

    python benchmarks/pipeline.py [MODEL] [--workers 2] [--worker-threads 1]
        [--worker-memory SIZE] [--threads 1] [--max-memory SIZE] [--tokens 64]
        [--rounds 2] [--serve 1,4] [--delay MS] [--json]

run     `infer run MODEL --no-chat --temp 0 -n TOKENS --json` --rounds times in one process
        (-t --threads, with --max-memory if given: layers streamed from disk) and as the
        coordinator of --workers workers (each -t --worker-threads, --max-memory
        --worker-memory); the best round's decode tok/s, its TTFT, and whether every
        answer's text is the one process's.
boundary  with --boundary: in one coordinator process (in namespace 0 with --delay), the
        median of 300 PING rounds of the ring (no work), and of 200 decode steps of one
        sequence over the stages against the same steps in one process (-t --threads):
        the overhead per stage boundary is the difference / (workers + 1).
serve   with --serve N,M: `infer serve MODEL --workers ... --parallel max(N, M)` and
        serve_batch.py's decode measurement at those stream counts (no one-process run).

netns   with --delay MS (root): the coordinator and each worker in a network namespace of
        their own, joined by veth pairs to a bridge, each namespace's veth with `tc netem
        delay MS` (a hop from one process to the next: MS; a round trip: 2 MS;
        the script measures a TCP round trip). Only the pipelined run. The
        namespaces are removed at the end, however the script ends but SIGKILL, and any
        left by an earlier run are removed first.

Workers listen on 127.0.0.1 (or their namespace's address) only, get a token file in a temporary directory, and are
killed at the end however the script ends (each dies with it: PR_SET_PDEATHSIG). Every
command has a time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPT = "Once upon a time, in a small village by the sea,"
INFER = [sys.executable, "-m", "infer.cli.main"]
# SIGKILL when this script ends, however it ends (Linux; kept across exec).
DIE_WITH_PARENT = (
    "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9); os.execv(sys.executable, sys.argv[1:])"
)
LIMIT = 600  # seconds any one command may take


NETNS = "infer-pl"  # namespaces infer-pl0 (the coordinator), infer-pl1.., infer-plhub


@contextlib.contextmanager
def namespaces(n: int, delay_ms: float):
    """n namespaces on one bridge, 10.77.0.1.. each, netem delay on each one's veth;
    yields the prefixes that run a command in each."""
    names = [f"{NETNS}{i}" for i in range(n)]

    def ip(*a, ns=None):
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *map(str, a)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def remove():  # ours: every namespace named infer-pl...
        r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
        for name in (line.split()[0] for line in r.stdout.splitlines() if line.strip()):
            if name.startswith(NETNS):
                subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)

    remove()
    try:
        hub = f"{NETNS}hub"
        ip("netns", "add", hub)
        ip("link", "add", "br0", "type", "bridge", ns=hub)
        ip("link", "set", "br0", "up", ns=hub)
        for i, name in enumerate(names):
            ip("netns", "add", name)
            ip("link", "add", "v0", "netns", name, "type", "veth", "peer", f"p{i}", "netns", hub)
            ip("addr", "add", f"10.77.0.{i + 1}/24", "dev", "v0", ns=name)
            ip("link", "set", "v0", "up", ns=name)
            ip("link", "set", "lo", "up", ns=name)
            ip("link", "set", f"p{i}", "master", "br0", ns=hub)
            ip("link", "set", f"p{i}", "up", ns=hub)
            if delay_ms:
                tc = ["tc", "qdisc", "add", "dev", "v0", "root", "netem", "delay", f"{delay_ms}ms"]
                r = subprocess.run(["ip", "netns", "exec", name, *tc], capture_output=True,
                                   text=True, timeout=30, check=False)  # fmt: skip
                if r.returncode != 0:
                    sys.exit(f"tc netem: {r.stderr.strip()} (no netem in this kernel?)")
        yield [["ip", "netns", "exec", name] for name in names]
    finally:
        remove()


ECHO = """import socket, sys, time
if sys.argv[1] == "serve":
    s = socket.create_server((sys.argv[2], 7799)); s.settimeout(30); c, _ = s.accept()
    while d := c.recv(64): c.sendall(d)
else:
    c = socket.create_connection((sys.argv[2], 7799), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t = time.perf_counter()
    for _ in range(200): c.sendall(b"x"); c.recv(64)
    print((time.perf_counter() - t) / 200 * 1000)
"""


def ping_ms(client: list[str], server: list[str], host: str) -> float:
    """The mean TCP round trip of a byte from one namespace to `host` in another, in ms
    (the machine may have no ping)."""
    echo = subprocess.Popen([*server, sys.executable, "-c", ECHO, "serve", host])
    try:
        for _ in range(50):  # until the server listens
            r = subprocess.run([*client, sys.executable, "-c", ECHO, "ask", host],
                               capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
            if r.returncode == 0:
                return float(r.stdout)
            time.sleep(0.1)
        sys.exit(f"no TCP round trip to {host}: {r.stderr.strip()}")
    finally:
        echo.kill()
        echo.wait(LIMIT)


class Worker:
    def __init__(self, token: Path, threads: int, memory: str | None, log: Path,
                 host: str = "127.0.0.1", prefix: list[str] = ()):  # fmt: skip
        cmd = [*INFER, "worker", "--host", host, "--port", "0", "--token-file", str(token),
               "-t", str(threads), *(["--max-memory", memory] if memory else [])]  # fmt: skip
        self.log, self.host = log, host
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", DIE_WITH_PARENT, *cmd], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        # (a worker on a non-loopback address first warns "listening on HOST: ...")
        while not (m := re.search(r"listening on \S+:(\d+)$", self.wait_for("listening on"))):
            pass
        self.port = int(m[1])

    def _read(self):
        with self.log.open("w") as f:
            for line in self.proc.stderr:
                f.write(line)
                f.flush()
                self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str) -> str:
        deadline = time.monotonic() + LIMIT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if text in line:
                return line
        sys.exit(f"worker: no {text!r}:\n{self.log.read_text()}")

    def peak_rss_mb(self) -> float:
        """The worker process's peak resident memory (VmHWM), MB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1000

    def kill(self):
        self.proc.kill()
        self.proc.wait(LIMIT)


def run_once(model: str, args, extra: list[str], prefix=()) -> dict:
    cmd = [*prefix, *INFER, "run", model, PROMPT, "--no-chat", "--temp", "0", "-n", str(args.tokens),
           "--json", *extra]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, check=False)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return json.loads(r.stdout)


def best(model: str, args, extra: list[str], prefix=()) -> dict:
    rounds = [run_once(model, args, extra, prefix) for _ in range(args.rounds)]
    top = max(rounds, key=lambda a: a["timings"]["decode_tok_s"])
    return {
        **top["timings"],
        "tokens": top["tokens_generated"],
        "texts": [a["text"] for a in rounds],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--worker-memory", help="each worker's --max-memory")
    ap.add_argument("--threads", type=int, default=1, help="the one process's and coordinator's")
    ap.add_argument("--max-memory", help="the one process's --max-memory")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--serve-tokens", type=int, default=64)
    ap.add_argument("--skip-single", action="store_true", help="only the pipelined runs")
    ap.add_argument("--delay", type=float, help="ms of netem delay a hop (namespaces)")
    ap.add_argument("--boundary", action="store_true", help="the ring's own cost (above)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--probe", nargs=2, metavar=("ADDRESSES", "TOKEN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:  # --boundary's coordinator, in its own process (namespace)
        print(json.dumps(probe(args.model, *args.probe, args.threads)))
        return

    results = {}
    if not (args.serve or args.boundary or args.skip_single) and args.delay is None:
        extra = ["-t", str(args.threads)] + (
            ["--max-memory", args.max_memory] if args.max_memory else []
        )
        results["one process"] = best(args.model, args, extra)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        token = Path(tmp) / "token"
        token.write_bytes(os.urandom(32))
        token.chmod(0o600)
        prefixes = hosts = None
        if args.delay is not None:
            prefixes = stack.enter_context(namespaces(args.workers + 1, args.delay))
            hosts = [f"10.77.0.{i + 1}" for i in range(args.workers + 1)]
            results["ping ms"] = ping_ms(prefixes[0], prefixes[1], hosts[1])
        workers = []
        try:
            for i in range(args.workers):
                log = Path(tmp) / f"worker{i}.log"
                where = {} if hosts is None else {"host": hosts[i + 1], "prefix": prefixes[i + 1]}
                workers.append(Worker(token, args.worker_threads, args.worker_memory, log, **where))
            addresses = ",".join(f"{w.host}:{w.port}" for w in workers)
            link = ["--workers", addresses, "--token-file", str(token)]
            if args.serve:
                results["serve"] = serve(args, link, Path(tmp))
            elif args.boundary:
                cmd = [*(prefixes[0] if prefixes else ()), sys.executable, __file__, args.model,
                       "--threads", str(args.threads), "--probe", addresses, str(token)]  # fmt: skip
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, check=False)
                if r.returncode != 0:
                    sys.exit(f"the probe failed:\n{r.stderr}")
                results["boundary"] = json.loads(r.stdout.splitlines()[-1])
            else:
                results[f"{args.workers} workers"] = best(
                    args.model,
                    args,
                    ["-t", str(args.threads), *link],
                    prefixes[0] if prefixes else (),
                )
            logs = [(Path(tmp) / f"worker{i}.log").read_text() for i in range(len(workers))]
            results["worker logs"] = [[x for x in t.splitlines() if "loaded" in x] for t in logs]
            results["worker peak RSS MB"] = [round(w.peak_rss_mb()) for w in workers]
        finally:
            for w in workers:
                w.kill()
    report(results, args)


def probe(model: str, addresses: str, token: str, threads: int) -> dict:
    """--boundary's figures, medians in ms: a PING round, a decode step over the stages,
    the same step in one process."""
    import statistics

    import torch

    from infer.runtime.loader import load_model
    from infer.runtime.pipeline import link
    from infer.runtime.pipeline.coordinator import load_pipelined
    from infer.runtime.registry import resolve
    from infer.runtime.session import Session

    torch.set_num_threads(threads)
    path = resolve(model).path
    workers = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in addresses.split(","))]
    secret = Path(token).read_bytes().strip()
    lm = load_pipelined(model, path, workers, secret, torch.float32, 2048)

    def ms(fn, n: int) -> float:
        for _ in range(10):
            fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def ping():
        receiving = link.Receiving(len(workers))
        link.Sending(link.Pass(link.Op.PING), 1).wait()
        receiving.wait(lm.stages.dim, lm.stages.dtype)

    def stepper(session: Session):
        token = [int(session.prefill(list(range(100, 140))).argmax())]

        def step():
            token[0] = int(session.step(token[0]).argmax())

        return step

    try:
        ring = ms(ping, 300)
        staged = ms(stepper(Session(lm.model, stages=lm.stages)), 200)
    finally:
        lm.stages.close()
    alone = ms(stepper(Session(load_model(path, max_seq_len=2048).model)), 200)
    hops = len(workers) + 1
    return {"ping_round_ms": ring, "step_ms": staged, "one_process_step_ms": alone,
            "per_boundary_ms": (staged - alone) / hops, "hops": hops}  # fmt: skip


def serve(args, link: list[str], tmp: Path) -> dict:
    """serve_batch.py's decode figures through `infer serve --workers`."""
    sys.path.insert(0, str(Path(__file__).parent))
    from serve_load import start_server

    extra = [*link, "-t", str(args.threads), "--parallel", str(max(args.serve))]
    proc, url = start_server(args.model, tmp / "serve.log", extra)
    try:
        cmd = [sys.executable, str(Path(__file__).parent / "serve_batch.py"), args.model,
               "--url", url, "--streams", ",".join(map(str, args.serve)), "--rounds",
               str(args.rounds), "--max-tokens", str(args.serve_tokens), "--json"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, check=False)
        if r.returncode != 0:
            sys.exit(f"serve_batch.py failed:\n{r.stderr}")
        return json.loads(r.stdout)
    finally:
        proc.kill()
        proc.wait(LIMIT)


def report(results: dict, args) -> None:
    if args.json:
        print(json.dumps(results, indent=1))
        return
    if "serve" in results:
        print(json.dumps(results["serve"], indent=1))
    if "ping ms" in results:
        print(f"TCP round trip between namespaces: {results['ping ms']:.3f} ms")
    if "boundary" in results:
        b = results["boundary"]
        print(f"PING round of {b['hops']} hops {b['ping_round_ms']:.3f} ms; decode step "
              f"{b['step_ms']:.2f} ms over the stages, {b['one_process_step_ms']:.2f} ms in "
              f"one process: {b['per_boundary_ms']:.2f} ms a stage boundary")  # fmt: skip
    texts = {k: v["texts"] for k, v in results.items() if isinstance(v, dict) and "texts" in v}
    for name, r in results.items():
        if isinstance(r, dict) and "decode_tok_s" in r:
            print(f"{name:>12}: decode {r['decode_tok_s']:6.1f} tok/s over {r['tokens']} tokens, "
                  f"TTFT {r['ttft_s']:.3f} s, load {r['load_s']:.2f} s")  # fmt: skip
    every = [t for ts in texts.values() for t in ts]
    if len(every) > 1:
        print(f"same text in every run: {len(set(every)) == 1}")
    for log, rss in zip(results.get("worker logs", []), results.get("worker peak RSS MB", [])):
        print(f"  {'; '.join(log)}; peak RSS {rss} MB")


if __name__ == "__main__":
    main()
