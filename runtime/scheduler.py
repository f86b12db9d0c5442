"""The scheduler: the one place that decides which requests a model works on.

A `Job` is one answer to produce (prompt ids, sampling, limits); the `Scheduler` of a
loaded model runs jobs on its own thread over `parallel` `Session` slots, each slot a
KV cache that keeps the tokens of its last conversation. A job takes the free slot
that already holds the longest prefix of its prompt (the same system prompt, the
earlier turns of a chat), so only the rest is prefilled: that is the prefix cache. A
start of it that another slot holds, busy or not, is copied from there; prompts that
arrive together with one start (OpenAI's n, a long shared system prompt) compute it once.

Continuous batching: every running job advances in the same decode pass
(session.decode), one pass a step. Between two steps one chunk of new jobs' prompts is
prefilled (prompts that arrive together share its pass), so the running answers pause
for a chunk at most. A job that ends (done, cancelled, its client gone) leaves the
batch at once and frees its slot for the next queued job, in order of arrival. A job
hands its text and its end to its `on_event` callback from the scheduler's thread.

Over pipeline stages the running jobs go in as many groups as there are stages, each
group's pass begun while the others are on the ring (session.start_decode): every stage
works on one group while the coordinator samples another's tokens.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import InferError
from .answer import Answer, Answering, prefill_answers
from .generate import Penalties, Sampler, make_sampler
from .model.llama import Transformer
from .model.tokenizer import Tokenizer
from .prompt_cache import PromptCache
from .session import DecodePass, Session, common_prefix, start_decode
from .speculative import Drafter, LookupDrafter, ModelDrafter

# Tokens of a prompt's start worth copying from another slot's cache rather than computing
SHARED = 16

if TYPE_CHECKING:
    from .pipeline.coordinator import Pipeline


@dataclass
class Sampling:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def sampler(self) -> Sampler:
        return make_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)


@dataclass
class Job:
    """One answer to generate. `on_event(kind, value)` is called from the scheduler's
    thread with ("text", piece) as text comes (with `logprobs`, just before it ("logprobs",
    [TokenLogprob]) for the piece's tokens), then once ("done", Answer) or ("error",
    InferError)."""

    prompt: list[int]
    max_tokens: int  # < 0: until the context is full
    on_event: Callable[[str, object], None]
    sampling: Sampling = field(default_factory=Sampling)
    penalties: Penalties | None = None
    stop: Sequence[str] = ()
    context: int | None = None  # the request's own context limit (ollama's num_ctx)
    constraint: object | None = None  # structured.Constraint: the answer keeps to a grammar
    logprobs: int | None = None  # give each token's log probability, and this many others'
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when a slot took it (its prefill began)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop after the pass it is in (or before starting); the answer so far is kept."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class Call:
    """Work on a slot's session other than an answer (an embedding): `fn(session)` runs
    on the scheduler's thread between two steps; `on_done` gets its result or error."""

    fn: Callable[[Session], object]
    on_done: Callable[[object], None]


@dataclass
class SchedulerStats:
    jobs: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a slot already held
    prefix_hits: int = 0  # jobs that reused at least one cached token
    generated_tokens: int = 0
    prefills: int = 0  # prompt passes (a chunk of one or several prompts)
    prefilled: int = 0  # answers those passes advanced, summed
    steps: int = 0  # decode passes
    batched: int = 0  # answers those passes advanced, summed: / steps is the mean batch
    guessed: int = 0  # tokens guessed (prompt lookup or a draft model) and checked
    accepted: int = 0  # of those, kept
    shared_tokens: int = 0  # prompt tokens copied from another slot's cache (also cached)
    restored_tokens: int = 0  # prompt tokens copied back from the prompt cache (also cached)


class Scheduler:
    """Runs the jobs of one model, on a thread of its own: up to `parallel` at once, each
    in a KV cache (slot) of `context` positions, in the model's cache format (new_cache's
    default: the loader's kv_cache); prompts prefilled `prefill_chunk` tokens between two
    decode passes."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        parallel: int = 4,
        context: int | None = None,
        threads: int | None = None,
        prefill_chunk: int = 256,
        lookup: bool = False,
        draft: Transformer | None = None,
        stages: Pipeline | None = None,
        cache_bytes: int = 0,
    ):
        """Speculative decoding: every answer guesses tokens, checked in the same pass as
        the other answers' tokens: from its prompt and text (`lookup`), or from the
        `draft` model (of the same vocabulary), which then keeps a cache of its own
        beside each slot. `stages`: the model's blocks run on workers (pipeline/), which
        keep the slots' caches; each pass of the batched step goes through them.
        `cache_bytes`: conversations a slot gives up are kept in memory up to this size
        (prompt_cache.py), so that a prompt that starts as one did need not compute it."""
        self.model, self.tokenizer = model, tokenizer
        self.lookup = lookup
        slots = range(max(1, parallel))
        self.slots = [Session(model, context, threads, stages) for _ in slots]
        self.context = self.slots[0].max_seq_len
        self.draft_slots = (
            [Session(draft, self.context, threads) for _ in self.slots] if draft else []
        )
        self.prompt_cache = PromptCache(cache_bytes, SHARED) if cache_bytes and not stages else None
        self.prefill_chunk = max(1, prefill_chunk)
        self._last_used = [0.0] * len(self.slots)
        self._queue: deque[Job] = deque()
        self._calls: deque[Call] = deque()  # run first, in a free slot, one a step
        # Running jobs by slot, in order of arrival; changed by the thread, under the lock.
        self._active: dict[int, tuple[Job, Answering]] = {}
        # Decode passes begun and not yet taken, oldest first: (slots with answers, pass).
        self._flying: deque[tuple[list[tuple[int, Answering]], DecodePass]] = deque()
        self.in_flight = len(stages.workers) if stages is not None else 1
        self._lock = threading.Condition()
        self._closing = False
        self.stopped = False  # cancel_all was called: no job runs any more
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._work, name="infer-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; once stopped, it ends at once, cancelled."""
        with self._lock:
            if not self.stopped:
                self._queue.append(job)
                self._lock.notify()
                return
        job.cancel()
        job.on_event("done", Answer(len(job.prompt), finish_reason="cancelled"))

    def call(self, call: Call) -> None:
        """Queue `call`; once stopped, it fails at once."""
        with self._lock:
            if not self.stopped:
                self._calls.append(call)
                self._lock.notify()
                return
        call.on_done(_unloaded())

    @property
    def waiting(self) -> int:
        """Jobs queued for a slot."""
        return len(self._queue)

    @property
    def running(self) -> int:
        """Jobs in a slot: prefilling or decoding."""
        return len(self._active)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._active or self._queue)

    def cancel_all(self) -> None:
        """Stop: cancel the running jobs, every queued one and every one submitted later
        (their callers get "done"). For a server that is stopping or unloading the model."""
        with self._lock:
            self.stopped = True
            jobs = [*self._queue, *(job for job, _ in self._active.values())]
            calls, self._calls = list(self._calls), deque()
            self._lock.notify()
        for job in jobs:
            job.cancel()
        for call in calls:
            call.on_done(_unloaded())

    def close(self, timeout: float | None = None) -> None:
        """Cancel everything and stop the thread; the slots' caches go with the object."""
        self.cancel_all()
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout)

    def slots_for(self, prompts: Sequence[list[int]], free: Sequence[int]) -> list[int]:
        """A slot of `free` for each prompt: the longest cached prefixes first (so that a
        prompt that matches nothing does not take the slot holding another's), then the
        least recently used."""
        reuse = {
            (k, i): self.slots[i].reused_prefix(p) for k, p in enumerate(prompts) for i in free
        }
        chosen: dict[int, int] = {}
        for k, i in sorted(reuse, key=lambda ki: (-reuse[ki], self._last_used[ki[1]])):
            if k not in chosen and i not in chosen.values():
                chosen[k] = i
        return [chosen[k] for k in range(len(prompts))]

    # -- the thread -----------------------------------------------------------------------

    def _work(self) -> None:
        while self._admit():
            self._call()
            self._sweep()
            self._prefill()
            self._step()

    def _admit(self) -> bool:
        """Wait for work; move queued jobs into free slots, first come first served.
        False once closed and nothing is left."""
        ended: list[tuple[Job, Answer | Exception]] = []
        with self._lock:
            while not (self._queue or self._active or self._calls or self._closing):
                self._lock.wait()
            if self._closing and not (self._queue or self._active or self._calls):
                return False
            free = [i for i in range(len(self.slots)) if i not in self._active]
            if self._calls:  # a slot stays free for the first call
                free = free[:-1]
            jobs = [self._queue.popleft() for _ in range(min(len(free), len(self._queue)))]
            for job, i in zip(jobs, self.slots_for([j.prompt for j in jobs], free)):
                try:
                    answering = self._start(job, i)
                except Exception as err:  # noqa: BLE001  (InferError: 4xx; a bug: 500)
                    ended.append((job, err))
                    continue
                if job.cancelled or self.stopped:
                    job.cancel()
                    answering.finish("cancelled")
                    ended.append((job, answering.answer))
                    continue
                self._active[i] = (job, answering)
        for job, result in ended:
            self._end(job, result)
        return True

    def _call(self) -> None:
        """The first queued call, in the least recently used free slot, if one is free."""
        with self._lock:
            free = [i for i in range(len(self.slots)) if i not in self._active]
            if not (self._calls and free):
                return
            call = self._calls.popleft()
        i = min(free, key=lambda i: self._last_used[i])
        self._last_used[i] = time.perf_counter()
        if self.prompt_cache is not None:  # the call overwrites the slot's conversation
            self.prompt_cache.save(self.slots[i])
        try:
            result = call.fn(self.slots[i])
        except Exception as err:  # noqa: BLE001  (InferError: 4xx; a bug: 500)
            result = err
        try:
            call.on_done(result)
        except Exception:  # noqa: BLE001  (the caller's bug: the thread goes on)
            traceback.print_exc()

    def _start(self, job: Job, i: int) -> Answering:
        job.started = time.perf_counter()
        session = self.slots[i]
        self._last_used[i] = job.started
        limit = min(job.context or session.max_seq_len, session.max_seq_len)
        if len(job.prompt) > limit:
            raise InferError(
                f"the prompt is {len(job.prompt)} tokens, longer than the context of {limit}"
            )
        room = limit - len(job.prompt) + 1  # the last token is sampled, never fed back
        max_tokens = room if job.max_tokens < 0 else min(job.max_tokens, room)
        answering = Answering(
            session,
            self.tokenizer,
            job.prompt,
            job.sampling.sampler(),
            max_tokens,
            lambda piece: job.on_event("text", piece),
            job.penalties,
            job.stop,
            cancelled=lambda: job.cancelled,
            constraint=job.constraint,
            drafter=self._drafter(i),
            logprobs=job.logprobs,
            on_logprobs=lambda entries: job.on_event("logprobs", entries),
        )
        answering.answer.context = limit
        return answering

    def _drafter(self, i: int) -> Drafter | None:
        """A new answer's drafter in slot `i` (its costs and acceptance are the answer's)."""
        if self.draft_slots:
            draft = self.draft_slots[i]
            return ModelDrafter(draft.model, self.model.args.vocab_size, session=draft)
        return LookupDrafter() if self.lookup else None

    def _sweep(self) -> None:
        """Cancelled jobs leave, running or queued."""
        with self._lock:
            gone = [job for job in self._queue if job.cancelled]
            for job in gone:
                self._queue.remove(job)
        for job in gone:
            self._end(job, Answer(len(job.prompt), finish_reason="cancelled"))
        flying = {i for group, _ in self._flying for i, _ in group}
        for i, (job, answering) in list(self._active.items()):
            if job.cancelled and i not in flying:  # else once its pass is back
                self._run(i, lambda a=answering: a.finish("cancelled"))

    def _prefill(self) -> None:
        """The next chunk of the earliest job still prefilling, in one pass with those of
        the jobs after it while their rows fit in one chunk's (prompts that arrive
        together start together). A prompt whose start another slot holds copies it
        from there, or waits while an earlier prompt computes it (_borrow)."""
        group, rows, earlier = [], 0, []
        for i, (_, a) in self._active.items():
            if not a.prefilling:
                continue
            waits = self._borrow(i, a, earlier)
            earlier.append(a)
            if waits:
                continue
            n = min(a.session.missing(a.prompt), self.prefill_chunk)
            if group and rows + n > self.prefill_chunk:
                break
            group.append((i, a))
            rows += n
        if not group:
            return
        out = self._pass(group, prefill_answers, [a for _, a in group], self.prefill_chunk)
        if out is None:
            return
        self.stats.prefills += 1
        self.stats.prefilled += len(group)
        for (i, a), logits in zip(group, out):
            self._run(i, lambda a=a, logits=logits: a.prefilled(logits))

    def _borrow(self, i: int, a: Answering, earlier: list[Answering]) -> bool:
        """Before slot i computes more of its prompt. The conversation the slot held, if
        the prompt does not continue it, goes to the prompt cache. True when the prompt
        should wait: an earlier prompt still computes a start they share that is at least
        half of what this one has left (answers to one prompt, OpenAI's n; requests with
        one long system prompt). Else, where another slot or the prompt cache holds a
        longer start of it (by SHARED tokens or more), copy those keys and values (a
        slot's draft model's too) rather than compute them; they count as cached."""
        session = a.session
        if session.stages is not None:  # the workers hold the caches
            return False
        cache = self.prompt_cache
        kept, entry = cache.longest(a.prompt) if cache is not None else (0, None)
        held = common_prefix(session.tokens, a.prompt, len(session.tokens))
        if cache is not None and len(session.tokens) - held >= SHARED:
            cache.save(session, keep=entry)
        have = session.reused_prefix(a.prompt)
        left = len(a.prompt) - have
        for b in earlier:
            common = common_prefix(a.prompt, b.prompt, len(a.prompt) - 1)
            if (
                common - have >= max(SHARED, left / 2)
                and b.session.reused_prefix(b.prompt) < common
            ):
                return True
        flying = {j for group, _ in self._flying for j, _ in group}
        others = [j for j in range(len(self.slots)) if j != i and j not in flying]
        best, j = max(((self.slots[j].reused_prefix(a.prompt), j) for j in others), default=(0, -1))
        if max(best, kept) < have + SHARED:
            return False
        if kept > best:
            cache.restore(session, entry, kept)
            self.stats.restored_tokens += kept - have
        else:
            session.copy_prefix(self.slots[j], best)
            if self.draft_slots:
                draft, source = self.draft_slots[i], self.draft_slots[j]
                n = source.reused_prefix(a.prompt)
                if n > draft.reused_prefix(a.prompt):
                    draft.copy_prefix(source, n)
            self.stats.shared_tokens += best - have
        a.answer.cached_tokens += max(best, kept) - have
        return False

    def _step(self) -> None:
        """Start a decode pass over the answers past their prefill that no pass holds,
        in as many groups as may fly (one; over pipeline stages one a stage); then
        take the oldest pass's tokens."""
        flying = {i for group, _ in self._flying for i, _ in group}
        ready = [
            (i, a) for i, (_, a) in self._active.items() if not a.prefilling and i not in flying
        ]
        for group in _groups(ready, self.in_flight - len(self._flying)):
            p = self._pass(group, _start_pass, group)
            if p is not None:
                self._flying.append((group, p))
        if not self._flying:
            return
        group, p = self._flying.popleft()
        logits = self._pass(group, p.wait)
        if logits is None:
            return
        self.stats.steps += 1
        self.stats.batched += len(group)
        for (i, a), rows in zip(group, logits):
            self._run(i, lambda a=a, rows=rows: a.take(rows))

    def _pass(self, group: list[tuple[int, Answering]], action: Callable, *args):
        """action(*args) for a pass over the jobs in `group`; if it fails, every one of
        them leaves with the error, and None is returned."""
        try:
            return action(*args)
        except Exception as err:  # noqa: BLE001  (every answer of the pass fails with it)
            for i, _ in group:
                self._leave(i, err)
            return None

    def _run(self, i: int, action: Callable[[], None]) -> None:
        """Do `action` for the job in slot `i`; if it ends the job, or fails, the job
        leaves its slot."""
        try:
            action()
        except Exception as err:  # noqa: BLE001  (InferError: 4xx; a bug: 500, serving goes on)
            self._leave(i, err)
            return
        answering = self._active[i][1]
        if answering.done:
            self._leave(i, answering.answer)

    def _leave(self, i: int, result: Answer | Exception) -> None:
        """The job in slot `i` leaves the batch, its slot free for the next."""
        with self._lock:
            job, answering = self._active.pop(i)
        drafter = answering.decoding.drafter
        if drafter is not None:
            self.stats.guessed += drafter.stats.guessed
            self.stats.accepted += drafter.stats.accepted
        self._end(job, result)

    def _end(self, job: Job, result: Answer | Exception) -> None:
        """Tell the job's caller how it ended: its Answer ("done") or an error."""
        if not isinstance(result, Answer):
            _tell(job, "error", result)
            return
        st = self.stats
        st.jobs += 1
        st.prompt_tokens += result.prompt_tokens
        st.cached_tokens += result.cached_tokens
        st.prefix_hits += result.cached_tokens > 0
        st.generated_tokens += len(result.tokens)
        _tell(job, "done", result)


def _start_pass(group: list[tuple[int, Answering]]) -> DecodePass:
    """The decode pass of the answers in `group`, begun."""
    return start_decode([a.session for _, a in group], [a.feed() for _, a in group])


def _groups(items: list, n: int) -> list[list]:
    """items in at most n runs of near-equal length, in order (none empty)."""
    n = min(n, len(items))
    bounds = [len(items) * k // n for k in range(n + 1)] if n > 0 else []
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


class Unloaded(InferError):
    http_status = 503  # a server's answer: not the request's fault


def _unloaded() -> Unloaded:
    return Unloaded("the model was unloaded: the server is stopping, or its keep-alive ended")


def _tell(job: Job, kind: str, value: object) -> None:
    try:
        job.on_event(kind, value)
    except Exception:  # noqa: BLE001  (the caller's bug: the thread and the other jobs go on)
        traceback.print_exc()
