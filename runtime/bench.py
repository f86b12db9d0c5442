"""Benchmark one model: load time, prefill and decode speed, TTFT, memory, bandwidth.

Napkin math for decode: each new token reads every weight once (the embedding table
excepted: one row of it), so decode is memory-bound and

    achieved GB/s = weight bytes per token x decode tok/s

is the number to hold against the machine's memory bandwidth (llm.c's bench style).
The KV cache and activations are left out: at short contexts they are small.

With `roofline=True` the bench also measures that bandwidth (`membw.read_bandwidth`),
turns it into a ceiling (bandwidth / weight bytes per token) and times where a decoded
token's time goes: inside the linear layers (nn.Linear and QuantLinear forwards, timed
by forward hooks in one extra, separate decode run) and everything else.
"""

from __future__ import annotations

import itertools
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import InferError
from ..offload.expert_stats import ExpertReport
from ..offload.stream import StreamReport, report
from ..quant.formats.base import QuantEmbedding, QuantLinear
from .files import hugepages
from .generate import generate, make_sampler
from .loader import load_model
from .model.kvcache import cache_bytes
from .model.llama import Transformer
from .session import Session, decode, prefill_together

# Real text, so the prompt is made of real token ids (cycled to the length asked for).
BENCH_TEXT = (
    "The history of computing is a story of machines that grew smaller, faster and "
    "cheaper while the problems put to them grew larger. Early computers filled rooms "
    "and drew enough power to light a street; their memories held a few thousand words. "
    "Today a phone holds billions of transistors and runs language models that answer "
    "questions, translate text and write programs. Memory bandwidth, not arithmetic, "
    "now limits how fast such a model can produce each new word, because every weight "
    "must travel from memory to the processor once per generated token."
)


@dataclass
class Roofline:
    """The decode ceiling memory bandwidth sets, and how close decode comes to it."""

    bandwidth_gb_s: float  # best streaming read with the bench's thread count
    bandwidth_method: str
    bandwidth_1thread_gb_s: float  # the same with one thread
    bandwidth_by_method: dict[str, float]  # GB/s, bench's thread count
    ceiling_tok_s: float  # bandwidth / weight bytes per token
    ratio: float  # achieved decode tok/s / ceiling


@dataclass
class Breakdown:
    """One decoded token's time: linear layers vs everything else (a hooked decode run)."""

    n_tokens: int
    ms_per_token: float  # with the hooks in place, so a little above 1000 / decode tok/s
    linear_ms_per_token: float
    other_ms_per_token: float  # attention, norms, rope, sampling, Python, hook overhead
    linear_fraction: float
    linear_weight_bytes: int  # bytes of the linear layers' weights, read once per token
    linear_gb_s: float  # linear_weight_bytes / linear time: the matmuls' own bandwidth
    linear_ms_by_name: dict[str, float]  # q_proj ... lm_head, summed over layers
    # With the fused decode step (runtime/model/fused_decode.py) the blocks run in one C call:
    # their matmuls are not hooked, and their whole time (matmuls included) is this.
    fused_blocks_ms_per_token: float = 0.0


@dataclass
class BenchResult:
    model: str
    path: str
    format: str
    quantization: str
    dtype: str
    threads: int
    n_prompt: int
    n_gen: int
    repeats: int
    n_params: int
    load_s: float
    ttft_s: float  # prefill of n_prompt tokens + the first sample (median)
    prefill_tok_s: float  # median
    decode_tok_s: float  # median
    peak_rss_bytes: int
    huge_page_bytes: int | None  # memory mapped in 2 MiB pages after the runs (hugepages.py)
    weight_bytes_per_token: int
    decode_gb_s: float  # weight_bytes_per_token x decode_tok_s / 1e9
    roofline: Roofline | None = None
    breakdown: Breakdown | None = None
    offload: StreamReport | None = None  # under --max-memory (or a model too large)
    experts: ExpertReport | None = None  # a MoE model's expert cache, decode steps only
    kernels: str = ""  # the C kernels' instruction-set path, as kernel_path() names it
    kv_cache: str = ""  # the KV cache's format (model/kvcache.py)
    kv_cache_bytes: int = 0  # its size at n_prompt + n_gen positions
    parallel: int = 1  # sequences decoded at once in the batched run (1: none)
    parallel_decode_tok_s: float | None = None  # their tokens in all a second (median)

    def rows(self) -> list[list[str]]:
        """(metric, value) pairs as text, for a table."""
        rows = [
            ["model", f"{self.model} ({self.format}, {self.quantization}, run as {self.dtype})"],
            ["threads", str(self.threads)],
            ["kernels", self.kernels],
            ["load", f"{self.load_s:.2f} s"],
            [f"prefill ({self.n_prompt} tok)", f"{self.prefill_tok_s:.1f} tok/s"],
            ["TTFT", f"{self.ttft_s * 1000:.0f} ms"],
            [f"decode ({self.n_gen} tok)", f"{self.decode_tok_s:.1f} tok/s"],
            *self._parallel_rows(),
            ["weights read per token", f"{self.weight_bytes_per_token / 1e6:.1f} MB"],
            ["achieved bandwidth", f"{self.decode_gb_s:.2f} GB/s"],
            ["KV cache", f"{self.kv_cache}, {self.kv_cache_bytes / 1e6:.1f} MB"],
            ["peak RSS", f"{self.peak_rss_bytes / 1e6:.0f} MB"],
            ["in huge pages", _huge_pages(self.huge_page_bytes)],
            ["repeats", f"{self.repeats} (median, after a warm-up)"],
        ]
        if o := self.offload:
            rows += _offload_rows(o)
        if e := self.experts:
            rows += _expert_rows(e)
        if r := self.roofline:
            bw = f"{r.bandwidth_gb_s:.2f} GB/s ({self.threads} threads, {r.bandwidth_method})"
            rows += [
                ["read bandwidth", f"{bw}; 1 thread {r.bandwidth_1thread_gb_s:.2f} GB/s"],
                ["decode ceiling", f"{r.ceiling_tok_s:.1f} tok/s (bandwidth / weights per token)"],
                ["achieved / ceiling", f"{100 * r.ratio:.0f} %"],
            ]
        if b := self.breakdown:
            share = f"{100 * b.linear_fraction:.0f} %, {b.linear_gb_s:.2f} GB/s"
            by_name = ", ".join(f"{k} {v:.2f}" for k, v in b.linear_ms_by_name.items())
            rows += [["per token (hooked run)", f"{b.ms_per_token:.2f} ms"]]
            if b.fused_blocks_ms_per_token:
                rows += [["  blocks (fused C step)", f"{b.fused_blocks_ms_per_token:.2f} ms"]]
            rows += [
                ["  linear layers", f"{b.linear_ms_per_token:.2f} ms ({share})"],
                ["  everything else", f"{b.other_ms_per_token:.2f} ms"],
                ["  linear by name (ms)", by_name],
            ]
        return rows

    def _parallel_rows(self) -> list[list[str]]:
        if self.parallel_decode_tok_s is None:
            return []
        n, tok_s = self.parallel, self.parallel_decode_tok_s
        each = f"{tok_s / n:.1f} each, {tok_s / self.decode_tok_s:.2f}x one sequence"
        return [[f"decode, {n} sequences at once", f"{tok_s:.1f} tok/s in all ({each})"]]


def _huge_pages(n: int | None) -> str:
    if n is None:
        return "unknown on this system"
    return f"{n / 1e6:.0f} MB"


def _offload_rows(o: StreamReport) -> list[list[str]]:
    mb = 1e6
    rows = [
        ["memory budget", f"{o.budget_bytes / mb:.0f} MB (planned {o.planned_bytes / mb:.0f} MB)"],
        ["footprint now", f"{o.footprint_bytes / mb:.0f} MB (RSS + model pages cached)"],
        [
            "layers",
            f"{o.layers_pinned} resident, {o.layers_streamed} streamed (window {o.window})",
        ],
        ["resident / streamed", f"{o.resident_bytes / mb:.0f} MB / {o.streamed_bytes / mb:.0f} MB"],
    ]
    if o.layers_streamed:
        rows += [
            ["read per token", f"{o.bytes_read_per_token / mb:.1f} MB"],
            ["read bandwidth", f"{o.read_gb_s:.2f} GB/s ({o.read_method}, crc32 {o.crc32_check})"],
            ["stalled on reads", f"{o.stall_s_per_token * 1000:.1f} ms per token"],
        ]
    return rows


def _expert_rows(e: ExpertReport) -> list[list[str]]:
    mb = 1e6
    per_layer = " ".join(f"{h:.2f}" for h in e.hit_rate_per_layer)
    cached = sum(e.slots)
    share = 100 * cached / e.experts_total
    each = f"{e.expert_bytes / mb:.2f} MB each; {e.policy}, {e.scheme} slots"
    used = f"{100 * e.prefetch_reads_used:.0f} % of those used"
    reads = f"{e.reads_per_token:.2f} experts, {e.prefetch_reads_per_token:.2f} by prefetch"
    rows = []
    if e.budget_bytes is not None:
        planned = f"{e.budget_bytes / mb:.0f} MB (planned {e.planned_bytes / mb:.0f} MB)"
        rows.append(["memory budget", planned])
    rows += [
        ["footprint now", f"{e.footprint_bytes / mb:.0f} MB (RSS + model pages cached)"],
        ["experts cached", f"{cached} of {e.experts_total} ({share:.1f} %, {each})"],
        ["expert hit rate", f"{e.hit_rate:.3f} (decode; per MoE layer {per_layer})"],
        ["prefetch precision / recall", f"{e.precision:.3f} / {e.recall:.3f}"],
        ["experts read per token", f"{e.bytes_read_per_token / mb:.2f} MB ({reads}; {used})"],
        ["expert reads", f"{e.read_gb_s:.2f} GB/s ({e.read_method}, crc32 {e.crc32_check})"],
        ["stalled on reads", f"{e.stall_s_per_token * 1000:.1f} ms per token"],
    ]
    if e.dense_layers_streamed:
        dense = f"{e.dense_layers_streamed} ({e.dense_bytes_read_per_token / mb:.1f} MB per token)"
        rows.append(["dense layers streamed", dense])
    return rows


def _embedding_table(model: Transformer) -> tuple[list[torch.Tensor], int, bool]:
    """The embedding table's tensors, the bytes of one row, and whether lm_head is it."""
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding):  # rows of a quantized table: (vocab, dim) packed
        table = embed.table
        return (
            list(table.tensors().values()),
            table.nbytes // table.out_features,
            table is model.lm_head,
        )
    w = embed.weight
    head = model.lm_head
    tied = isinstance(head, nn.Linear) and head.weight.data_ptr() == w.data_ptr()
    return [w], w[0].nbytes, tied


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decoded token reads.

    Every parameter and persistent buffer (quantized weights live in buffers) counts
    once, except the embedding table, of which a token reads one row. A tied lm_head
    reads the whole table, so then it counts in full, once. A mixture of experts' routed
    experts count top_k / n_experts of their bytes: a token runs k of them per layer.
    Float or quantized alike.
    """
    table, row_bytes, tied = _embedding_table(model)
    table_ptrs = {t.data_ptr() for t in table}
    seen: set[int] = set()
    total = 0 if tied else row_bytes
    args = model.args
    routed = args.n_experts_per_tok / args.n_experts if args.n_experts else 1.0
    # state_dict holds parameters and persistent buffers only (no KV cache, no rope tables).
    for name, t in model.state_dict(keep_vars=True).items():
        # A streamed layer's tensors are meta between uses (offload/): no data pointer.
        key = id(t) if t.is_meta else t.data_ptr()
        if key in seen:
            continue
        seen.add(key)
        if tied or t.data_ptr() not in table_ptrs:
            total += t.nbytes * (routed if ".mlp.experts." in name else 1.0)
    return int(total)


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The matmuls: every nn.Linear and QuantLinear, by qualified name.

    A module reachable by two names (a tied quantized table is also embed_tokens.table)
    appears once, under its last name (lm_head, the one whose forward runs).
    """
    by_id = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, (nn.Linear, QuantLinear)):
            by_id[id(m)] = (name, m)
    return dict(by_id.values())


def _weight_nbytes(m: nn.Module) -> int:
    if isinstance(m, QuantLinear):
        return m.nbytes
    return m.weight.nbytes


class LinearTimer:
    """Forward hooks that add up the wall time spent inside linear layers, by leaf name.

    CPU ops run synchronously, so the time between a module's pre-hook and its hook is its
    forward. The hooks cost a few microseconds a call, which lands outside the linears.
    """

    def __init__(self, model: nn.Module):
        self.seconds: dict[str, float] = {}
        self._start: dict[int, float] = {}
        self._handles = []
        for name, m in linear_modules(model).items():
            leaf = name.rsplit(".", 1)[-1]
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post(leaf)))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, leaf: str):
        def hook(module, args, output):
            dt = time.perf_counter() - self._start.pop(id(module))
            self.seconds[leaf] = self.seconds.get(leaf, 0.0) + dt

        return hook

    def reset(self) -> None:
        self.seconds.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def decode_breakdown(session: Session, prompt: list[int], n_gen: int) -> Breakdown:
    """Decode n_gen tokens with LinearTimer hooks; split each token's time."""
    model = session.model
    timer = LinearTimer(model)
    fused, fused_s = session.fused, [0.0]
    if fused is not None:

        def timed(*args):
            t = time.perf_counter()
            out = fused(*args)
            fused_s[0] += time.perf_counter() - t
            return out

        timed.max_rows = fused.max_rows
        session.fused = timed
    try:
        session.reset()
        tokens = generate(session, prompt, make_sampler(temperature=0), max_tokens=n_gen + 1)
        next(tokens)  # prefill and the first token: not decode
        timer.reset()
        fused_s[0] = 0.0
        t0 = time.perf_counter()
        for _ in tokens:
            pass
        total = time.perf_counter() - t0
    finally:
        timer.remove()
        session.fused = fused
    linear = sum(timer.seconds.values())
    hooked = linear_modules(model)
    if fused is not None:  # the blocks' linears ran inside the fused step, unhooked
        hooked = {k: m for k, m in hooked.items() if not k.startswith("layers.")}
    linear_bytes = sum(_weight_nbytes(m) for m in hooked.values())
    return Breakdown(
        n_tokens=n_gen,
        ms_per_token=1000 * total / n_gen,
        linear_ms_per_token=1000 * linear / n_gen,
        other_ms_per_token=1000 * (total - linear - fused_s[0]) / n_gen,
        linear_fraction=linear / total,
        linear_weight_bytes=linear_bytes,
        linear_gb_s=linear_bytes * n_gen / linear / 1e9,
        linear_ms_by_name={k: 1000 * v / n_gen for k, v in timer.seconds.items()},
        fused_blocks_ms_per_token=1000 * fused_s[0] / n_gen,
    )


def measure_roofline(
    decode_tok_s: float, bytes_per_token: int, threads: int, nbytes: int | None = None
) -> Roofline:
    """Measure read bandwidth (with `threads` and with 1) and hold decode against it."""
    from .membw import read_bandwidth

    bw = read_bandwidth(threads, nbytes)
    one = bw if threads == 1 else read_bandwidth(1, nbytes)
    ceiling = bw.bytes_per_s / bytes_per_token
    return Roofline(
        bandwidth_gb_s=bw.gb_s,
        bandwidth_method=bw.method,
        bandwidth_1thread_gb_s=one.gb_s,
        bandwidth_by_method={k: v / 1e9 for k, v in bw.by_method.items()},
        ceiling_tok_s=ceiling,
        ratio=decode_tok_s / ceiling,
    )


def kernel_path() -> str:
    """The quantized kernels' instruction-set path, and how prompts multiply on it, as
    llama.cpp's system line shows its SIMD flags: "avx512vnni (prompts: integer dot
    products)", "avx2 (prompts: float32)", or the torch reference's note."""
    from ..kernels_cpu import ops

    if not ops.available():
        return "torch reference (C extension not built)"
    how = "integer dot products" if ops.integer_gemm() else "float32"
    return f"{ops.isa()} (prompts: {how})"


def peak_rss_bytes() -> int:
    """This process's peak resident set size.

    Linux: VmHWM, the high-water mark of this process's own memory. Not ru_maxrss: exec
    carries the parent's peak into it, so `infer bench` started by a large process (a
    script that made the model, a test run) would report the parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes; Linux: KiB


def bench_prompt(tokenizer, n: int) -> list[int]:
    """`n` real token ids: BENCH_TEXT tokenized and cycled."""
    ids = tokenizer.encode(BENCH_TEXT, add_special=False)
    return list(itertools.islice(itertools.cycle(ids), n))


def _timed_run(session: Session, prompt: list[int], n_gen: int, snapshot=None):
    """One cold-cache greedy run: (seconds to the first token, seconds for n_gen more,
    and what `snapshot()` counted over those n_gen if given, else None)."""
    session.reset()  # recompute the whole prompt
    greedy = make_sampler(temperature=0)
    # n_gen + 1 tokens: the first comes from prefill, each later one costs one forward.
    tokens = generate(session, prompt, greedy, max_tokens=n_gen + 1)
    t0 = time.perf_counter()
    next(tokens)
    t1 = time.perf_counter()
    before = snapshot() if snapshot else None
    for _ in tokens:  # not stopping at EOS: the speed is what is measured
        pass
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, (snapshot() - before) if snapshot else None


def _timed_batch(sessions: list[Session], prompt: list[int], n_gen: int) -> float:
    """Seconds for n_gen greedy decode passes over every session at once (as a server
    runs its concurrent answers), after their prompts: `prompt` rotated by one token a
    session, so that each is a sequence of its own."""
    prompts = [prompt[i % len(prompt) :] + prompt[: i % len(prompt)] for i in range(len(sessions))]
    for s in sessions:
        s.reset()
    last = prefill_together(sessions, prompts, len(prompt))
    t0 = time.perf_counter()
    for _ in range(n_gen):
        out = decode(sessions, [[int(x.argmax())] for x in last])
        last = [o[-1] for o in out]
    return time.perf_counter() - t0


def run_bench(
    path: Path,
    *,
    n_prompt: int = 128,
    n_gen: int = 64,
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    roofline: bool = False,
    bandwidth_bytes: int | None = None,
    max_memory: int | None = None,
    expert_policy: str | None = None,
    trace: Path | None = None,
    expert_prediction: str | None = None,
    kv_cache: str | None = None,
    parallel: int = 1,
) -> BenchResult:
    """Load the model at `path` and time it; figures are medians over `repeats` runs.

    roofline: also measure memory bandwidth (over a `bandwidth_bytes` buffer,
    default 1 GiB) for the decode ceiling, and split decode time by a hooked run.
    max_memory: a footprint budget (bytes); layers beyond it stream from disk, and the
    result's `offload` has the streaming figures of the timed runs. A mixture-of-experts
    model caches experts instead (`expert_policy`, `expert_prediction`), and `experts`
    has the cache's figures over the timed runs' decode steps. trace: save its routing
    there. kv_cache: the KV cache's format (default the compute dtype's). parallel > 1:
    also decode that many sequences at once, one pass a token for all (session.decode).
    """
    if n_prompt < 1 or n_gen < 1 or repeats < 1 or parallel < 1:
        raise InferError("n_prompt, n_gen, repeats and parallel must be at least 1")
    lm = load_model(
        path,
        dtype,
        max_seq_len=n_prompt + n_gen + 1,
        max_memory=max_memory,
        expert_policy=expert_policy,
        record_routing=trace is not None,
        expert_prediction=expert_prediction,
        kv_cache=kv_cache,
    )
    model = lm.model
    if n_prompt + n_gen > model.max_seq_len:
        raise InferError(
            f"{n_prompt} prompt + {n_gen} generated tokens exceed the model's context "
            f"of {model.max_seq_len}"
        )
    prompt = bench_prompt(lm.tokenizer, n_prompt)
    session = Session(model)
    _timed_run(session, prompt, min(n_gen, 4))  # warm-up: allocator, caches, lazy init
    if lm.stream is not None:
        lm.stream.reset_stats()  # streaming figures of the timed runs only
    snapshot = lm.experts.snapshot if lm.experts is not None else None
    runs = [_timed_run(session, prompt, n_gen, snapshot) for _ in range(repeats)]
    offload = None if lm.plan is None else report(lm.plan, lm.stream, lm.source.checkpoint.file)
    experts = None
    if lm.experts is not None:
        decode = sum((r[2] for r in runs[1:]), runs[0][2])
        experts = lm.experts.report(decode, phase="decode")
    if trace is not None and lm.routing is not None:
        lm.routing.trace().save(trace)
    ttft = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    bytes_per_token = weight_bytes_per_token(model)
    decode_tok_s = n_gen / decode_s
    threads = torch.get_num_threads()
    rss = peak_rss_bytes()  # before the bandwidth buffer (1 GiB) is allocated
    huge = hugepages.mapped_bytes()
    parallel_tok_s = None
    if parallel > 1:
        sessions = [session] + [Session(model) for _ in range(parallel - 1)]
        _timed_batch(sessions, prompt, min(n_gen, 4))  # warm-up
        batch_s = statistics.median(_timed_batch(sessions, prompt, n_gen) for _ in range(repeats))
        parallel_tok_s = parallel * n_gen / batch_s
    ceiling = breakdown = None
    if roofline:
        breakdown = decode_breakdown(session, prompt, n_gen)
        ceiling = measure_roofline(decode_tok_s, bytes_per_token, threads, bandwidth_bytes)
    info = lm.source
    return BenchResult(
        model=name or Path(path).name,
        path=str(info.path),
        format=info.format,
        quantization=info.quantization,
        dtype=str(dtype).removeprefix("torch."),
        threads=threads,
        n_prompt=n_prompt,
        n_gen=n_gen,
        repeats=repeats,
        n_params=info.args.n_params,
        load_s=lm.load_seconds,
        ttft_s=ttft,
        prefill_tok_s=statistics.median(n_prompt / r[0] for r in runs),
        decode_tok_s=decode_tok_s,
        peak_rss_bytes=rss,
        huge_page_bytes=huge,
        weight_bytes_per_token=bytes_per_token,
        decode_gb_s=bytes_per_token * decode_tok_s / 1e9,
        roofline=ceiling,
        breakdown=breakdown,
        offload=offload,
        experts=experts,
        kernels=kernel_path(),
        kv_cache=session.cache[0].kind,
        kv_cache_bytes=cache_bytes(model.args, n_prompt + n_gen, session.cache[0].kind),
        parallel=parallel,
        parallel_decode_tok_s=parallel_tok_s,
    )
