"""The scheduler: the one place that decides which request a model works on.

A `Job` is one answer to produce (prompt ids, sampling, limits); the
`Scheduler` of a loaded model runs jobs on its own thread over a few `Session` slots,
each slot a KV cache that keeps the tokens of its last conversation. A job goes to the
slot that already holds the longest prefix of its prompt (the same system prompt, the
earlier turns of a chat), so only the rest is prefilled: that is the prefix cache.

Jobs run one at a time, in order of arrival; a job hands its text and its end to its
`on_event` callback from the scheduler's thread. A batched decode step would step
every running job's slot at once here, behind the same `submit`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import InferError
from .answer import Answer, stream_answer
from .generate import Penalties, Sampler, make_sampler
from .model.llama import Transformer
from .model.tokenizer import Tokenizer
from .session import Session


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
    thread with ("text", piece) as text comes, then once ("done", Answer) or
    ("error", InferError)."""

    prompt: list[int]
    max_tokens: int  # < 0: until the context is full
    on_event: Callable[[str, object], None]
    sampling: Sampling = field(default_factory=Sampling)
    penalties: Penalties | None = None
    stop: Sequence[str] = ()
    context: int | None = None  # the request's own context limit (ollama's num_ctx)
    constraint: object | None = None  # structured.Constraint: the answer keeps to a grammar
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None  # when a slot took it
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop at the next token (or before starting); the answer so far is kept."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


@dataclass
class SchedulerStats:
    jobs: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a slot already held
    prefix_hits: int = 0  # jobs that reused at least one cached token
    generated_tokens: int = 0


class Scheduler:
    """Runs the jobs of one model, on a thread of its own, over `slots` KV caches of
    `context` positions each."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        slots: int = 2,
        context: int | None = None,
        threads: int | None = None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.slots = [Session(model, context, threads) for _ in range(max(1, slots))]
        self.context = self.slots[0].max_seq_len
        self._last_used = [0.0] * len(self.slots)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._running: Job | None = None
        self._lock = threading.Lock()  # between a submit and a stop
        self.stopped = False  # cancel_all was called: no job runs any more
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._work, name="infer-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue `job`; once stopped, it ends at once, cancelled."""
        with self._lock:
            if not self.stopped:
                self._queue.put(job)
                return
        job.cancel()
        job.on_event("done", Answer(len(job.prompt), finish_reason="cancelled"))

    @property
    def waiting(self) -> int:
        """Jobs queued behind the running one."""
        return self._queue.qsize()

    @property
    def running(self) -> int:
        """Jobs running now (one at a time: a batched step would run several)."""
        return int(self._running is not None)

    @property
    def busy(self) -> bool:
        return self._running is not None or not self._queue.empty()

    def cancel_all(self) -> None:
        """Stop: cancel the running job, every queued one and every one submitted later
        (their callers get "done"). For a server that is stopping or unloading the model."""
        with self._lock:
            self.stopped = True
            jobs = [self._running, *self._queue.queue]
        for job in jobs:
            if job is not None:
                job.cancel()

    def close(self, timeout: float | None = None) -> None:
        """Cancel everything and stop the thread; the slots' caches go with the object."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout)

    def slot_for(self, prompt: list[int]) -> int:
        """The slot holding the longest prefix of `prompt`; else the least recently used."""
        reuse = [s.reused_prefix(prompt) for s in self.slots]
        best = max(range(len(self.slots)), key=lambda i: (reuse[i], -self._last_used[i]))
        return best

    # -- the thread -----------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            self._running = job
            if self.stopped:  # taken from the queue as cancel_all looked at it
                job.cancel()
            try:
                self._run(job)
            except Exception as err:  # noqa: BLE001  (InferError: 4xx; a bug: 500, and serving goes on)
                job.on_event("error", err)
            finally:
                self._running = None

    def _run(self, job: Job) -> None:
        job.started = time.perf_counter()
        i = self.slot_for(job.prompt)
        session = self.slots[i]
        self._last_used[i] = job.started
        limit = min(job.context or session.max_seq_len, session.max_seq_len)
        if len(job.prompt) > limit:
            raise InferError(
                f"the prompt is {len(job.prompt)} tokens, longer than the context of {limit}"
            )
        room = limit - len(job.prompt) + 1  # the last token is sampled, never fed back
        max_tokens = room if job.max_tokens < 0 else min(job.max_tokens, room)
        if job.cancelled:
            answer = Answer(len(job.prompt), context=limit, finish_reason="cancelled")
        else:
            answer = stream_answer(
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
            )
            answer.context = limit
        st = self.stats
        st.jobs += 1
        st.prompt_tokens += answer.prompt_tokens
        st.cached_tokens += answer.cached_tokens
        st.prefix_hits += answer.cached_tokens > 0
        st.generated_tokens += len(answer.tokens)
        job.on_event("done", answer)
