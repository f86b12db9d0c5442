"""The models a server holds: found by the names `infer run` takes, loaded on first use,
unloaded after their keep-alive, the least recently used first when memory is short.

Only registry models on disk, the models the server was started with, and files under
the folders it was started with can be named: a request cannot make it read any file.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import torch

from ... import InferError
from ...offload.budget import format_size
from ...runtime.loader import (
    FITS_SHARE,
    LoadedModel,
    estimated_bytes,
    kv_cache_bytes,
    load_model,
)
from ...runtime.registry import DEFAULT_MODEL, ResolvedModel, find_entry, resolve
from ...runtime.scheduler import Scheduler
from .errors import ApiError


@dataclass
class ServeSettings:
    models: list[str] = field(default_factory=list)  # named on the command line: loaded first
    model_dirs: list[Path] = field(default_factory=list)  # files under these may be named
    ctx: int = 4096  # each slot's context (at most the model's)
    dtype: torch.dtype = torch.float32
    kv_cache: str | None = None  # the slots' KV cache format (default the dtype's)
    max_memory: int | None = None  # the process's budget (loader.load_model)
    parallel: int = 4  # answers a model runs at once: its KV caches (slots), kept for reuse
    prefill_chunk: int = 256  # prompt tokens prefilled between two decode passes
    cache_bytes: int = 0  # conversations slots gave up, kept in memory (prompt_cache.py)
    lookup: bool = False  # answers guess tokens from their prompts (speculative decoding)
    draft: str | None = None  # or from this model, for the models of its vocabulary
    keep_alive: float | None = 300.0  # seconds idle before unloading; None: never
    threads: int | None = None
    # The blocks on these `infer worker`s (runtime/pipeline/), proving `token`: one model
    workers: list[tuple[str, int]] | None = None
    token: bytes | None = None
    cors_origins: list[str] = field(
        default_factory=list
    )  # web pages' origins let in besides local ones


@dataclass
class Loaded:
    name: str  # as first asked for
    resolved: ResolvedModel
    lm: LoadedModel
    scheduler: Scheduler
    held: int  # bytes: the weights' estimate and the slots' KV caches
    keep_alive: float | None
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    # Requests prepared for this model that have not ended: from the moment a request
    # gets the model, before its job reaches the scheduler, it must not be unloaded.
    pending: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)

    @property
    def size(self) -> int:
        """Bytes held: the weights' estimate, the slots' KV caches, the prompt cache's."""
        cache = self.scheduler.prompt_cache
        return self.held + (cache.nbytes if cache is not None else 0)

    @property
    def context(self) -> int:
        return self.scheduler.context

    @property
    def in_use(self) -> bool:
        return self.scheduler.busy or len(self.pending) > 0

    def expires_in(self) -> float | None:
        """Seconds left before an idle unload (None: never; while in use, the whole
        keep-alive: it counts from the end of the last answer)."""
        if self.keep_alive is None:
            return None
        if self.in_use:
            return self.keep_alive
        return self.keep_alive - (time.monotonic() - self.last_used)

    def touch(self, keep_alive: float | None | bool = False) -> None:
        """Mark as used now; a request's own `keep_alive` (ollama's) replaces the default."""
        self.last_used = time.monotonic()
        if keep_alive is not False:
            self.keep_alive = keep_alive


def parse_keep_alive(value) -> float | None:
    """ollama's keep_alive: seconds as a number, or "10m", "1h30m", "45s", "500ms";
    negative means forever (None), 0 unload at once."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value < 0 else float(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError("keep_alive must be a duration such as 5m, or a number of seconds")
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        seconds = _duration(text)
    return None if seconds < 0 else seconds


def _duration(text: str) -> float:
    import re

    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    sign = -1 if text.startswith("-") else 1
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text.lstrip("-"))
    if not parts or "".join(n + u for n, u in parts) != text.lstrip("-"):
        raise ValueError(f"keep_alive {text!r} is not a duration such as 5m, 1h or 30s")
    return sign * sum(float(n) * units[u] for n, u in parts)


class ModelPool:
    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.loaded: dict[Path, Loaded] = {}  # by the model's path
        self._loading: dict[Path, asyncio.Task] = {}
        self._lock = asyncio.Lock()  # one load or unload decision at a time
        # Paths that may be named: the command line's files and folders, as given and
        # as resolved.
        dirs = [Path(os.path.abspath(Path(p).expanduser())) for p in settings.model_dirs]
        self._allowed = list(dict.fromkeys([*dirs, *(d.resolve() for d in dirs)]))
        self._named: dict[str, ResolvedModel] = {}
        self._draft = resolve(settings.draft, download=False) if settings.draft else None
        for name in settings.models:
            r = resolve(name, download=False)
            self._named[name] = r
            self._allowed.append(r.path.resolve())

    @property
    def default_name(self) -> str:
        return self.settings.models[0] if self.settings.models else DEFAULT_MODEL

    # -- naming -----------------------------------------------------------------------

    def resolve(self, name: str | None) -> ResolvedModel:
        """The model a request names, if this server may serve it (404 otherwise)."""
        name = (name or "").strip() or self.default_name
        if name.endswith(":latest") and find_entry(name) is None:
            name = name[: -len(":latest")]  # ollama clients' default tag
        if name in self._named:
            return self._named[name]
        path = Path(name).expanduser()
        try:
            if find_entry(name) is None and path.exists():
                real = path.resolve()
                if not self._may_serve(path):
                    raise ApiError(
                        404,
                        f"model {name!r} is not served here: the server serves registry "
                        "models and the files it was started with (infer serve MODEL, "
                        "--models-dir DIR)",
                    )
                return resolve(str(real), download=False)
            return resolve(name, download=False)
        except InferError as err:
            raise ApiError(404, str(err)) from None

    def _may_serve(self, path: Path) -> bool:
        """Whether `path` is under a folder the server was started with (or is one of its
        files): as resolved, or as named if the name has no "..", so that a link someone
        put in a served folder may lead elsewhere but a request cannot climb out."""
        named = [Path(os.path.abspath(path))] if ".." not in path.parts else []
        return any(
            p == a or a in p.parents for p in [path.resolve(), *named] for a in self._allowed
        )

    # -- loading ----------------------------------------------------------------------

    async def get(self, name: str | None, keep_alive: float | None | bool = False) -> Loaded:
        """The loaded model `name` names, loading it if needed (and unloading the least
        recently used idle ones first if it would not fit)."""
        resolved = self.resolve(name)
        key = resolved.path.resolve()
        async with self._lock:
            loaded = self.loaded.get(key)
            if loaded is not None and loaded.lm.stages is not None and loaded.lm.stages.failed:
                await self.unload(loaded)  # a worker died: form the pipeline again
                loaded = None
            task = self._loading.get(key)
            if loaded is None and task is None:
                task = asyncio.ensure_future(self._load(name or self.default_name, resolved))
                self._loading[key] = task
        if loaded is None:
            try:
                loaded = await asyncio.shield(task)
            finally:
                self._loading.pop(key, None)
        loaded.touch(keep_alive)
        return loaded

    async def _load(self, name: str, resolved: ResolvedModel) -> Loaded:
        from ...runtime.files.sources import open_source

        s = self.settings
        if s.workers is not None and resolved.path != self._named[s.models[0]].path:
            raise ApiError(404, f"{name}: with --workers this server serves {s.models[0]} only")
        source = open_source(resolved.path)
        args = source.args
        draft = (
            self._draft if self._draft is not None and self._draft.path != resolved.path else None
        )
        draft_source = open_source(draft.path) if draft is not None else None
        draft_bytes = draft_source and estimated_bytes(
            draft_source, s.dtype, s.ctx, s.parallel, s.kv_cache
        )
        need = estimated_bytes(source, s.dtype, s.ctx, s.parallel, s.kv_cache)
        kept = s.cache_bytes if s.workers is None else 0  # no prompt cache over workers
        await self._make_room(need + (draft_bytes or 0) + kept)

        def load() -> Loaded:
            budget = s.max_memory
            if budget is not None:  # the loader plans for one KV cache: room for the others
                ctx = min(s.ctx, args.max_seq_len)
                one = kv_cache_bytes(args, s.dtype, ctx, s.kv_cache)
                budget -= (s.parallel - 1) * one + (draft_bytes or 0)
                if budget <= 0:
                    raise InferError(
                        f"--max-memory {format_size(s.max_memory)} does not hold its "
                        f"{s.parallel} slots' KV caches of {format_size(one)} each: lower "
                        "--parallel or --ctx, or raise --max-memory"
                    )
            if s.workers is not None:
                from ...runtime.pipeline.coordinator import load_pipelined

                ref = s.models[0]  # as the workers are to find it
                lm = load_pipelined(
                    ref, resolved.path, s.workers, s.token, s.dtype, s.ctx, kv_cache=s.kv_cache
                )
            else:
                lm = load_model(
                    resolved.path, s.dtype, max_seq_len=s.ctx, max_memory=budget,
                    kv_cache=s.kv_cache,
                )  # fmt: skip
            draft_lm = self._load_draft(lm, name, draft_source)
            scheduler = Scheduler(
                lm.model, lm.tokenizer, s.parallel, s.ctx, s.threads, s.prefill_chunk,
                s.lookup, draft_lm and draft_lm.model, lm.stages, s.cache_bytes,
            )  # fmt: skip
            slots = scheduler.slots + scheduler.draft_slots
            kv = sum(c.nbytes for slot in slots for c in slot.cache or ())
            if s.max_memory is not None and scheduler.prompt_cache is not None:
                from ...offload.stream import process_rss

                # the prompt cache gets what the budget leaves, the slots filled
                room = s.max_memory - process_rss() - kv
                scheduler.prompt_cache.max_bytes = max(0, min(s.cache_bytes, room))
            size = lm.source.held_bytes(s.dtype) + kv
            if draft_lm is not None and draft_lm is not lm:
                size += draft_lm.source.held_bytes(s.dtype)
            return Loaded(name, resolved, lm, scheduler, size, s.keep_alive)

        try:
            loaded = await anyio.to_thread.run_sync(load)
        except InferError as err:
            raise ApiError(400, f"{name}: {err}") from None
        self.loaded[resolved.path.resolve()] = loaded
        return loaded

    def _load_draft(self, lm: LoadedModel, name: str, source) -> LoadedModel | None:
        """The draft model for `lm` (--draft), loaded (itself when it is the draft), or
        None: no --draft, or one of another vocabulary (the model answers without it, and
        the server says so once)."""
        from ...runtime.speculative import check_draft_tokenizer

        if self._draft is None:
            return None
        if source is None:
            return lm
        try:
            check_draft_tokenizer(source.tokenizer(), lm.tokenizer, self._draft.name, name)
        except InferError as err:
            print(f"warning: {err}: {name} answers without it", file=sys.stderr)
            return None
        s = self.settings
        return load_model(self._draft.path, s.dtype, max_seq_len=s.ctx, kv_cache=s.kv_cache)

    async def _make_room(self, need: int) -> None:
        """Unload idle models, least recently used first, while `need` bytes (a model with
        its slots' KV caches) would not fit."""
        import psutil

        from ...offload.stream import process_rss
        from ...runtime.files.hugepages import give_back_freed_heap

        s = self.settings
        while self.loaded:
            give_back_freed_heap()  # freed activations kept for reuse count as free
            if s.max_memory is not None:
                fits = process_rss() + need <= s.max_memory
            else:
                fits = need <= FITS_SHARE * psutil.virtual_memory().available
            idle = [m for m in self.loaded.values() if not m.in_use]
            if fits or not idle:
                return
            await self.unload(min(idle, key=lambda m: m.last_used))

    async def unload(self, loaded: Loaded) -> None:
        self.loaded.pop(loaded.resolved.path.resolve(), None)
        await anyio.to_thread.run_sync(loaded.scheduler.close)
        if loaded.lm.stages is not None:  # the workers wait for their next coordinator
            await anyio.to_thread.run_sync(loaded.lm.stages.close)
        del loaded
        gc.collect()

    async def reap(self) -> None:
        """Unload models idle past their keep-alive; runs until cancelled."""
        while True:
            for m in list(self.loaded.values()):
                left = m.expires_in()
                if left is not None and left <= 0 and not m.in_use:
                    await self.unload(m)
            await asyncio.sleep(0.5)

    def cancel_all(self) -> None:
        """Cancel every running and queued answer (the server is stopping)."""
        for m in self.loaded.values():
            m.scheduler.cancel_all()

    def close(self) -> None:
        for m in list(self.loaded.values()):
            m.scheduler.close(timeout=5)
            if m.lm.stages is not None:
                m.lm.stages.close()
        self.loaded.clear()
