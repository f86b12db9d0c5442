"""Conversations kept beyond the slots: when a slot takes another conversation, the keys
and values of the one it held are copied here, up to a size in bytes, and a later prompt
that starts as one of them did gets them back instead of computing them (what
llama-server's --cache-ram does). The least recently used go first.

    cache = PromptCache(1 << 30)
    n, entry = cache.longest(prompt)    # the longest start of prompt an entry holds
    cache.save(session, keep=entry)     # before the session's cache is overwritten
    cache.restore(session, entry, n)    # the session holds prompt[:n]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .session import Session, common_prefix


@dataclass(eq=False)
class Entry:
    tokens: list[int]
    state: list[dict[str, torch.Tensor]]  # Session.prefix_state's form, copied
    nbytes: int


class PromptCache:
    def __init__(self, max_bytes: int, min_tokens: int = 16):
        """Entries of `min_tokens` or more, together at most `max_bytes`."""
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: list[Entry] = []  # least recently used first
        self.nbytes = 0

    def save(self, session: Session, keep: Entry | None = None) -> None:
        """Keep what `session` holds (unless an entry holds it already, or it is too
        short, or does not fit beside `keep`, an entry about to be restored). Entries it
        starts with go: it holds them."""
        tokens = session.tokens
        n = len(tokens)
        if n < self.min_tokens or session.stages is not None:
            return
        for e in self.entries:
            if common_prefix(e.tokens, tokens, n) == n:
                self._touch(e)
                return
        state = session.prefix_state(n)
        size = sum(t.nbytes for layer in state for t in layer.values())
        if size + (keep.nbytes if keep is not None else 0) > self.max_bytes:
            return
        for e in [e for e in self.entries if common_prefix(e.tokens, tokens, n) == len(e.tokens)]:
            self._drop(e)
        while self.nbytes + size > self.max_bytes:
            self._drop(next(e for e in self.entries if e is not keep))
        copied = [{name: t.clone() for name, t in layer.items()} for layer in state]
        self.entries.append(Entry(list(tokens), copied, size))
        self.nbytes += size

    def longest(self, prompt: list[int]) -> tuple[int, Entry | None]:
        """The longest start of `prompt` an entry holds, short of its last token (always
        computed, for its logits), and that entry."""
        best, found = 0, None
        for e in self.entries:
            n = common_prefix(e.tokens, prompt, len(prompt) - 1)
            if n > best:
                best, found = n, e
        return best, found

    def restore(self, session: Session, entry: Entry, n: int) -> None:
        """Make `session` hold the entry's first `n` tokens."""
        session.load_prefix(entry.state, entry.tokens[:n])
        self._touch(entry)

    def _touch(self, e: Entry) -> None:
        self.entries.remove(e)
        self.entries.append(e)

    def _drop(self, e: Entry) -> None:
        self.entries.remove(e)
        self.nbytes -= e.nbytes
