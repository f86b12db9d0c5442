"""A session: one conversation's run state over a loaded model.

The model is weights; a Session holds what one sequence adds: its KV cache, the tokens
the cache holds (so the next prompt reuses the longest common prefix), the fused decode
plan over both, and the thread policy its forward passes run under. Several sessions
can share one model, each with its own cache.

    session = Session(model)               # context up to the model's rope tables
    logits = session.prefill(prompt_ids)   # (vocab,) after the last prompt token
    session.prefill_chunk(prompt_ids, 256) # the same a chunk a call: None until the last
    prefill_together([s1, s2], [p1, p2], 256)  # the same for several sequences in one pass
    logits = session.step(token)           # one token on: the fused step where it runs
    out = decode([s1, s2], [[t1], [t2, t3]])  # several sequences in one pass: logits per row
    p = start_decode([s1], [[t1]]); ...; out = p.wait()  # the same, the pass begun first
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .. import InferError
from ..kernels_cpu.threads import ThreadPolicy
from .model.fused_decode import FusedDecode, cache_words
from .model.llama import Rows, Transformer

if TYPE_CHECKING:
    from .pipeline.coordinator import Pipeline


class Session:
    def __init__(
        self,
        model: Transformer,
        max_seq_len: int | None = None,
        threads: int | None = None,
        stages: Pipeline | None = None,
        kv_cache: str | None = None,
    ):
        """`max_seq_len`: the cache's positions (default and at most the model's);
        `threads`: the kernels' threads (default torch.get_num_threads() at each pass).
        `stages`: the blocks run on other machines (pipeline/coordinator.py), which
        keep the sequence's cache; the model here holds none. `kv_cache`: the cache's
        format (model/kvcache.py; default the model's new_cache's)."""
        self.model, self.stages = model, stages
        self.cache = model.new_cache(max_seq_len, kv_cache) if stages is None else []
        self.sequence = stages.new_sequence() if stages is not None else None
        n = min(max_seq_len or model.max_seq_len, model.max_seq_len)
        self.max_seq_len = self.cache[0].k.shape[2] if self.cache else n
        self.tokens: list[int] = []  # ids whose keys and values the cache holds, in order
        self._threads = threads
        self.rebuild()

    def rebuild(self) -> None:
        """Plan the fused step and the thread policy again over the model's current
        weights: after swapping its modules (quantizing, tuning) or its weights."""
        self.fused = FusedDecode.prepare(self.model)
        self.cache_words = cache_words(self.cache) if self.fused is not None else None
        self.threads = ThreadPolicy(self._threads, kernels=self.model.runs_on_kernels())

    def reset(self) -> None:
        """Forget the sequence: the next prefill computes every token."""
        self.tokens.clear()

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], pos: int, all_logits: bool = False, states: bool = False
    ) -> torch.Tensor:
        """Logits (T or 1, vocab) of `tokens` at positions [pos, pos + T) in one torch pass
        (a prompt's chunk), or with `states` the final norm's states (T, dim); their keys
        and values go into the cache, and `self.tokens` becomes what the cache holds."""
        ids = torch.tensor([tokens])
        blocks = None
        if self.stages is not None:
            blocks = self.stages.blocks([(self.sequence, pos, len(tokens))], rows=False)
        with self.threads.forward():
            out = self.model(ids, pos, self.cache, all_logits, blocks=blocks, states=states)
        del self.tokens[pos:]
        self.tokens.extend(tokens)
        return out[0]

    @torch.inference_mode()
    def states(self, tokens: list[int], chunk: int = 512) -> torch.Tensor:
        """The final norm's states (T, dim) of `tokens` from position 0, `chunk` tokens a
        pass (what an embedding pools); the cache then holds them."""
        parts = range(0, len(tokens), chunk)
        return torch.cat([self.forward(tokens[p : p + chunk], p, states=True) for p in parts])

    def prefill(self, prompt: list[int], chunk: int = 512) -> torch.Tensor:
        """Bring the cache to hold `prompt`; return the logits (vocab,) after its last token.

        The cache keeps the longest common prefix with what it already holds (a chat
        turn re-sends the whole conversation; only the new part is computed)."""
        while (logits := self.prefill_chunk(prompt, chunk)) is None:
            pass
        return logits

    def prefill_chunk(self, prompt: list[int], chunk: int = 512) -> torch.Tensor | None:
        """One step of `prefill`: compute the next `chunk` tokens of `prompt` the cache
        lacks. Returns the logits (vocab,) after its last token once the cache holds all
        of it, else None (a server runs other sequences between the chunks)."""
        return prefill_together([self], [prompt], chunk)[0]

    def missing(self, prompt: list[int]) -> int:
        """How many tokens of `prompt` a prefill computes: those after the reused prefix."""
        return len(prompt) - self.reused_prefix(prompt)

    def reused_prefix(self, prompt: list[int]) -> int:
        """How many of `prompt`'s first tokens the cache already holds (at least one token
        is always computed again, for its logits)."""
        return common_prefix(self.tokens, prompt, len(prompt) - 1)

    def prefix_state(self, n: int) -> list[dict[str, torch.Tensor]]:
        """The keys and values (and their scales) of the first `n` positions, per layer,
        as views of the cache. Not over pipeline stages, whose workers hold the caches."""
        return [{name: b[:, :, :n] for name, b in layer.named_buffers()} for layer in self.cache]

    def load_prefix(self, state: list[dict[str, torch.Tensor]], tokens: list[int]) -> None:
        """Hold `tokens`, their keys and values copied from `state` (prefix_state's form,
        of this model and cache format, at least as many positions)."""
        n = len(tokens)
        for layer, saved in zip(self.cache, state, strict=True):
            for name, buf in layer.named_buffers():
                buf[:, :, :n] = saved[name][:, :, :n]
        self.tokens[:] = tokens

    def copy_prefix(self, source: Session, n: int) -> None:
        """Hold `source`'s first `n` tokens, copied from its cache: another sequence of
        the same model that computed a prefix this one needs."""
        self.load_prefix(source.prefix_state(n), source.tokens[:n])

    def step(self, token: int) -> torch.Tensor:
        """Logits (vocab,) after appending `token` to the sequence."""
        return decode([self], [[token]])[0][-1]

    def truncate(self, n: int) -> None:
        """Keep the sequence's first `n` tokens (guessed tokens that were not accepted go;
        their cache positions are written again by the next pass)."""
        del self.tokens[n:]


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many first tokens `a` and `b` share, at most `limit`: by halving, each step a
    comparison of list slices (C speed), for prompts of thousands of tokens."""
    lo, hi = 0, max(0, min(limit, len(a), len(b)))  # a[:lo] == b[:lo]; no match past hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@torch.inference_mode()
def prefill_together(
    sessions: Sequence[Session], prompts: Sequence[list[int]], chunk: int = 512
) -> list[torch.Tensor | None]:
    """`Session.prefill_chunk` of several sequences of one model in one pass: the next
    `chunk` tokens of each prompt its session's cache lacks, all rows through each
    weight at once (prompts that arrive together start together). Per session the
    logits (vocab,) after its prompt's last token once its cache holds all of it, else
    None. Each row sees only its own sequence; the matmul of more rows may take another
    kernel than alone, so a prompt's logits can differ from alone's in the last bits."""
    model = sessions[0].model
    if len({id(s) for s in sessions}) < len(sessions):
        raise ValueError("prefill: a session appears twice")
    spans, parts = [], []  # (pos, n, cache) and the tokens of each sequence's chunk
    for session, prompt in zip(sessions, prompts, strict=True):
        if session.model is not model:
            raise ValueError("prefill: the sessions run different models")
        if not prompt:
            raise InferError("empty prompt")
        if len(prompt) > session.max_seq_len:
            raise InferError(
                f"prompt is {len(prompt)} tokens, longer than the context of "
                f"{session.max_seq_len} (raise --ctx)"
            )
        n = session.reused_prefix(prompt)
        parts.append(prompt[n : n + chunk])
        spans.append((n, len(parts[-1]), session.cache))
    ids, rows, first = torch.tensor([[t for part in parts for t in part]]), Rows(spans), sessions[0]
    blocks = None
    if first.stages is not None:
        seqs = [(s.sequence, pos, n) for s, (pos, n, _) in zip(sessions, spans)]
        blocks = first.stages.blocks(seqs, rows=False)
    with first.threads.forward():
        logits = model(ids, None, rows, blocks=blocks)[0]  # each sequence's last row
    out = []
    for session, prompt, part, (pos, _, _), row in zip(sessions, prompts, parts, spans, logits):
        del session.tokens[pos:]
        session.tokens.extend(part)
        out.append(row if pos + len(part) == len(prompt) else None)
    return out


def decode(sessions: Sequence[Session], tokens: Sequence[list[int]]) -> list[torch.Tensor]:
    """One pass over several sequences of one model: session i's sequence goes on by
    `tokens[i]` (a token as it decodes, or a run of guessed tokens to check). Returns
    per session the logits (len(tokens[i]), vocab) after each of its tokens.

    A sequence's logits are those of decoding its tokens one at a time alone, whichever
    sequences share the pass: the fused step (where the model runs on it) reads every
    weight once for all rows, up to its most rows a call, and computes each row as alone.
    Over pipeline stages each stage runs its blocks so (pipeline/stage.py)."""
    return start_decode(sessions, tokens).wait()


@torch.inference_mode()
def start_decode(sessions: Sequence[Session], tokens: Sequence[list[int]]) -> DecodePass:
    """`decode`'s pass, begun: over pipeline stages it is on the ring when this returns
    (another group of sequences can start its own meanwhile); elsewhere it is done."""
    if not sessions:
        return DecodePass([], torch.empty(0))
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise ValueError("decode: the sessions run different models")
    if len({id(s) for s in sessions}) < len(sessions):
        raise ValueError("decode: a session appears twice")
    for session, toks in zip(sessions, tokens, strict=True):
        if not toks:
            raise ValueError("decode: a sequence with no tokens")
        if len(session.tokens) + len(toks) > session.max_seq_len:
            raise InferError(f"the context of {session.max_seq_len} tokens is full")
    rows = [(i, t) for i, toks in enumerate(tokens) for t in toks]  # in order
    spans, owners = [], []  # runs of one sequence's rows: (pos, n, cache)
    for i, _ in rows:
        if owners and owners[-1] == i:
            pos, n, cache = spans[-1]
            spans[-1] = (pos, n + 1, cache)
        else:
            s = sessions[i]
            spans.append((len(s.tokens), 1, s.cache))
            owners.append(i)
    ids, spans = torch.tensor([[t for _, t in rows]]), Rows(spans)
    first, logits, finish = sessions[0], None, None
    with first.threads.forward():  # torch's own ops on one thread too
        if first.stages is not None:
            seqs = [(sessions[i].sequence, p, n) for i, (p, n, _) in zip(owners, spans.spans)]
            flight = first.stages.start(model.embed(ids), seqs, rows=True)

            @torch.inference_mode()
            def finish() -> torch.Tensor:  # the output layer over the stages' states
                x = flight.wait()
                with first.threads.forward():
                    return model.head(x, spans, all_logits=True)[0]
        else:
            blocks = None
            if first.fused is not None:
                words = torch.stack([sessions[i].cache_words for i, _ in rows])
                blocks = functools.partial(_fused_rows, first.fused, spans, words)
            logits = model(ids, None, spans, all_logits=True, blocks=blocks)[0]
    parts, a = [], 0
    for i, (_, n, _) in zip(owners, spans.spans):
        sessions[i].tokens.extend(t for _, t in rows[a : a + n])
        parts.append((a, a + n))
        a += n
    return DecodePass(parts, logits, finish)


class DecodePass:
    """A pass of `start_decode`: `wait()` gives per session the logits (n, vocab) after
    each of its tokens; over pipeline stages the output layer runs then."""

    def __init__(self, parts: list[tuple[int, int]], logits=None, finish=None):
        """`logits` (rows, vocab) of a pass done, or `finish` gives them (on the ring)."""
        self.parts, self._logits, self._finish = parts, logits, finish

    def wait(self) -> list[torch.Tensor]:
        if self._logits is None:
            self._logits = self._finish()
        return [self._logits[a:b] for a, b in self.parts]


def _fused_rows(fused: FusedDecode, rows: Rows, words: torch.Tensor, x, _pos) -> torch.Tensor:
    """The model's `blocks` for a pass of rows: the fused step over their caches."""
    return fused(x, rows, words)
