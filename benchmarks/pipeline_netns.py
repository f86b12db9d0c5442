"""One model over worker processes in network namespaces, with latency on the links:
decode tok/s and the cost of each stage boundary against the link's round trip.

    python benchmarks/pipeline_netns.py [MODEL] [--workers 2] [--delays 0,0.5,2]
        [-n 64] [--rounds 2] [--threads 1]

Run as root (ip netns, tc). It makes one namespace for the coordinator and one per
worker, each joined by a veth pair to a bridge in a namespace of its own, and adds
`tc netem delay D` on every host's side, so each message from one stage to the next
waits D (a round trip 2 D; a kernel without the sch_netem module runs only delay 0). The
round trip is measured as one byte over TCP, echoed. It first runs `infer run --local`
in the coordinator's namespace with as many threads as all the stages together; then,
for each delay, starts `infer worker` in each worker namespace and runs `infer run MODEL
--workers ... --json` greedy, --rounds times. A decode step crosses workers + 1
boundaries (the ring back to the coordinator), so the cost of one boundary is
(1 / piped - 1 / local) / (workers + 1) seconds a token. Everything it made is removed at
the end, on Ctrl-C or on failure, and every process it starts has a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

PREFIX = f"infbench{os.getpid() % 10000}"  # namespace and link names, unique per run
PORT = 17070
TIMEOUT = 600  # seconds, for any one process
PROMPT = "Write a short story about a robot who learns to paint."


def sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    return subprocess.run(full, check=check, capture_output=True, text=True, timeout=60)


@contextmanager
def network(hosts: list[str]):
    """Namespaces PREFIX-<host> on 10.99.0.0/24 behind a bridge; yields host -> address."""
    bridge_ns = f"{PREFIX}-br"
    made = []
    try:
        sh("ip", "netns", "add", bridge_ns)
        made.append(bridge_ns)
        sh("ip", "link", "add", "br0", "type", "bridge", ns=bridge_ns)
        sh("ip", "link", "set", "br0", "up", ns=bridge_ns)
        addresses = {}
        for i, host in enumerate(hosts):
            ns, addr = f"{PREFIX}-{host}", f"10.99.0.{i + 1}"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", f"p{i}",
               "netns", bridge_ns)  # fmt: skip
            sh("ip", "link", "set", f"p{i}", "master", "br0", "up", ns=bridge_ns)
            sh("ip", "addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            sh("ip", "link", "set", "eth0", "up", ns=ns)
            sh("ip", "link", "set", "lo", "up", ns=ns)
            addresses[host] = addr
        yield addresses
    finally:
        for ns in reversed(made):
            sh("ip", "netns", "del", ns, check=False)


def set_delay(hosts: list[str], ms: float) -> None:
    for host in hosts:
        ns = f"{PREFIX}-{host}"
        sh("tc", "qdisc", "del", "dev", "eth0", "root", ns=ns, check=False)
        if ms > 0:
            cmd = ("tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", f"{ms}ms")
            done = sh(*cmd, ns=ns, check=False)
            if done.returncode:  # a kernel without sch_netem: "qdisc kind is unknown"
                sys.exit(f"cannot add {ms} ms of delay: tc says {done.stderr.strip()}")


ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""
ROUND_TRIPS = """
import socket, statistics, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
        break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(50):
    t = time.perf_counter()
    c.sendall(b"x")
    c.recv(64)
    times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e3)
"""


def tcp_rtt(client_ns: str, server_ns: str, addr: str) -> float:
    """The median round trip of one byte over TCP between two namespaces, in ms."""
    server = subprocess.Popen(["ip", "netns", "exec", server_ns, sys.executable, "-c", ECHO,
                               addr, str(PORT + 1)])  # fmt: skip
    try:
        out = sh(sys.executable, "-c", ROUND_TRIPS, addr, str(PORT + 1), ns=client_ns).stdout
        return float(out)
    finally:
        server.kill()
        server.wait()


def infer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from infer.cli import main; main()", *args]


@contextmanager
def workers(addresses: list[str], token: Path, threads: int, model: str):
    procs = []
    try:
        for i, addr in enumerate(addresses):
            cmd = infer_cmd("worker", "--host", addr, "--port", str(PORT), "--token-file",
                            str(token), "-t", str(threads))  # fmt: skip
            full = ["timeout", str(TIMEOUT), "ip", "netns", "exec", f"{PREFIX}-w{i + 1}", *cmd]
            procs.append(subprocess.Popen(full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for p, addr in zip(procs, addresses):
            wait_for(p, f"listening on {addr}:{PORT}".encode(), deadline=time.time() + 120)
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_for(p: subprocess.Popen, line: bytes, deadline: float) -> None:
    """Read the worker's stderr until `line` (it listens), or fail."""
    seen = b""
    while line not in seen:
        ready, _, _ = select.select([p.stderr], [], [], max(0.0, deadline - time.time()))
        chunk = os.read(p.stderr.fileno(), 4096) if ready else b""
        if not chunk:
            sys.exit(f"a worker did not start: {seen.decode(errors='replace')[-2000:]}")
        seen += chunk


def run_once(ns: str, model: str, n: int, extra: list[str]) -> dict:
    cmd = infer_cmd("run", model, PROMPT, "-n", str(n), "--temperature", "0", "--json", *extra)
    full = ["timeout", str(TIMEOUT), "ip", "netns", "exec", ns, *cmd]
    proc = subprocess.run(full, check=False, capture_output=True, text=True, timeout=TIMEOUT + 10)
    if proc.returncode:
        sys.exit(f"infer run failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--delays", default="0,0.5,2", help="one-way delay per host, ms")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per worker")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: ip netns and tc")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # so cleanup runs
    hosts = ["c", *(f"w{i + 1}" for i in range(args.workers))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, network(hosts) as addr:
        token = Path(tmp) / "token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        spec = ",".join(f"{addr[h]}:{PORT}" for h in hosts[1:])
        threads = str(args.threads * args.workers)
        local = [run_once(f"{PREFIX}-c", args.model, args.n, ["--local", "-t", threads])]
        texts = {local[0]["text"]}
        for ms in (float(d) for d in args.delays.split(",")):
            set_delay(hosts, ms)
            rtt = tcp_rtt(f"{PREFIX}-c", f"{PREFIX}-w1", addr["w1"])
            with workers([addr[h] for h in hosts[1:]], token, args.threads, args.model):
                piped = ["--workers", spec, "--token-file", str(token)]
                runs = [
                    run_once(f"{PREFIX}-c", args.model, args.n, piped) for _ in range(args.rounds)
                ]
            texts.update(r["text"] for r in runs)
            rows.append((ms, rtt, runs))
    base = max(r["timings"]["decode_tok_s"] for r in local)
    print(f"in one process, {threads} threads: {base:.1f} tok/s; same text everywhere: "
          f"{len(texts) == 1}")  # fmt: skip
    print("| delay per host | TCP round trip | decode tok/s | TTFT | per boundary | RTT + 1 ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for ms, rtt, runs in rows:
        tok_s = max(r["timings"]["decode_tok_s"] for r in runs)
        ttft = min(r["timings"]["ttft_s"] for r in runs)
        boundary = (1 / tok_s - 1 / base) / (args.workers + 1) * 1e3
        print(f"| {ms} ms | {rtt:.2f} ms | {tok_s:.1f} | {ttft:.2f} s | {boundary:.2f} ms "
              f"| {rtt + 1:.2f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
