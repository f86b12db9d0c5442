"""SentencePiece's merges recovered from its scores, for a BPE that tokenizes as llama.cpp's
SPM tokenizer does (tokenizer.py builds Gemma 3's and Llama 2's vocabularies with them).

`spm_merges` finds every split of every token into two tokens at once with numpy: the
parts are looked up by a polynomial hash of their characters (`_SubstringHash`, a
bucketed `_HashIndex`), each pair found is then compared character for character, so a
hash collision cannot make a merge. `spm_merges_reference` is the plain Python
definition it must equal (tests/test_tokenizer.py compares them, Gemma 3's 514,847
merges included).
"""

import itertools

import numpy as np


def spm_merges(tokens: list[str], scores: list[float], kept: list[bool]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores.

    llama.cpp's SPM tokenizer repeatedly joins the adjacent pair whose concatenation is
    the best-scoring token. As BPE: every split of a token into two tokens is a merge,
    ranked by the joined token's score (highest first), then the longer left part, then
    vocabulary order, as transformers' GGUF converter builds them. Only normal and
    user-defined tokens take part: control, byte and unused tokens are never produced by
    merging (SentencePiece's rule): `kept` says which tokens take part. `spm_merges_reference`
    is the same in plain Python.

    Every split of every token (1.2M for Gemma 3's vocabulary) is looked up at once: the
    two parts by a hash of their characters, each found pair then compared in full.
    """
    n = len(tokens)
    if n == 0:
        return []
    kept = np.array(kept, bool)
    chars = np.frombuffer("".join(tokens).encode("utf-32-le"), np.uint32)
    lens = np.fromiter(map(len, tokens), np.int64, n)
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    table = _SubstringHash(chars)

    # The kept tokens by hash; two with one hash (never seen) leave it to the reference.
    ids = np.flatnonzero(kept)
    if len(ids) == 0:
        return []
    find = _HashIndex(table.of(starts[ids], starts[ids + 1]), ids)
    if not find.unique:
        return spm_merges_reference(tokens, scores, kept)

    # Every split: token `whole`, left part of `k` characters.
    wholes = ids[lens[ids] > 1]
    cuts = lens[wholes] - 1
    whole = np.repeat(wholes, cuts)
    k = np.arange(len(whole)) - np.repeat(np.cumsum(cuts) - cuts, cuts) + 1
    cut = starts[whole] + k
    left = find(table.of(starts[whole], cut))
    hit = (left >= 0) & (lens[left] == k)
    whole, k, cut, left = whole[hit], k[hit], cut[hit], left[hit]
    right = find(table.of(cut, starts[whole + 1]))
    hit = (right >= 0) & (lens[right] == lens[whole] - k)
    whole, k, left, right = whole[hit], k[hit], left[hit], right[hit]

    same = np.ones(len(whole), bool)
    for run in _runs(lens[whole], _AT_ONCE):
        same[run] = _joined(chars, starts, whole[run], k[run], left[run], right[run])
    whole, k, left, right = whole[same], k[same], left[same], right[same]

    rank = np.lexsort((whole, -k, -np.array(scores, np.float64)[whole]))
    # Each part is the vocabulary's own string: a new one per part would hold ~100 MB
    # more (Gemma 3's) while tokenizers builds its BPE from them.
    parts = np.stack([left[rank], right[rank]], axis=1).ravel()
    merges = []
    for start in range(0, len(parts), 2 * _AT_ONCE):  # whole pairs
        found = map(tokens.__getitem__, parts[start : start + 2 * _AT_ONCE].tolist())
        merges += zip(found, found)
    return merges


_AT_ONCE = 1 << 18  # characters compared, or merges picked, at once (arrays of 2-4 MB)


def _runs(sizes: np.ndarray, total: int) -> list[slice]:
    """Consecutive slices of `sizes` summing to about `total` each (one item at least)."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, np.arange(total, ends[-1] if len(ends) else 0, total))
    bounds = np.unique(np.concatenate(([0], cuts + 1, [len(sizes)])))
    return [slice(a, b) for a, b in itertools.pairwise(bounds.tolist())]


def _joined(chars, starts, whole, k, left, right) -> np.ndarray:
    """Whether each token `whole` is the text of `left` (`k` characters) then of `right`,
    compared character by character, so that a hash collision cannot make a merge."""
    size = starts[whole + 1] - starts[whole]
    pair = np.repeat(np.arange(len(whole)), size)
    j = np.arange(len(pair)) - np.repeat(np.cumsum(size) - size, size)
    kj = k[pair]
    part = np.where(j < kj, starts[left][pair] + j, starts[right][pair] + j - kj)
    same = np.ones(len(whole), bool)
    same[pair[chars[starts[whole][pair] + j] != chars[part]]] = False
    return same


class _SubstringHash:
    """Polynomial hashes of substrings of one character array, modulo 2**64:
    h(s) = sum s[j] * B**j, for chars[start:end] from prefix sums in O(1)."""

    BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64

    def __init__(self, chars: np.ndarray):
        powers = np.full(len(chars) + 1, self.BASE, np.uint64)
        powers[0] = 1
        inverse = np.full(len(chars) + 1, pow(self.BASE, -1, 2**64), np.uint64)
        inverse[0] = 1
        with np.errstate(over="ignore"):
            self._inverse = np.cumprod(inverse, dtype=np.uint64)
            self._prefix = np.zeros(len(chars) + 1, np.uint64)
            np.cumsum(chars * np.cumprod(powers, dtype=np.uint64)[:-1], out=self._prefix[1:])

    def of(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """The hash of each chars[start:end], its bits mixed (splitmix64's finalizer, a
        bijection) so that short strings spread over the top bits too."""
        with np.errstate(over="ignore"):
            h = (self._prefix[end] - self._prefix[start]) * self._inverse[start]
            h ^= h >> np.uint64(30)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(27)
            h *= np.uint64(0x94D049BB133111EB)
            h ^= h >> np.uint64(31)
            return h


class _HashIndex:
    """Finds the id of a hash among `hashes` (uniformly spread): the sorted hashes are
    cut into buckets by their top bits, about one hash a bucket, so a lookup reads a
    bucket or two rather than binary-searching the whole array."""

    def __init__(self, hashes: np.ndarray, ids: np.ndarray):
        order = np.argsort(hashes)
        self._hashes, self._ids = hashes[order], ids[order]
        self.unique = not np.any(self._hashes[1:] == self._hashes[:-1])
        bits = len(ids).bit_length()
        self._shift = np.uint64(64 - bits)
        top = (self._hashes >> self._shift).astype(np.int64)
        self._bucket = np.searchsorted(top, np.arange(2**bits + 1))

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """The id with each hash of `h`, else -1."""
        top = (h >> self._shift).astype(np.int64)
        at, end = self._bucket[top], self._bucket[top + 1]
        out = np.full(len(h), -1, np.int64)
        todo = np.flatnonzero(at < end)
        while len(todo):
            found = self._hashes[at[todo]] == h[todo]
            out[todo[found]] = self._ids[at[todo[found]]]
            todo = todo[~found]
            at[todo] += 1
            todo = todo[at[todo] < end[todo]]
        return out


def spm_merges_reference(
    tokens: list[str], scores: list[float], kept: list[bool]
) -> list[tuple[str, str]]:
    """`spm_merges` in plain Python, one split at a time."""
    names = {t for t, keep in zip(tokens, kept) if keep}
    # Ranked by score, then the longer left part, then vocabulary order (i).
    found = [
        (-scores[i], -k, i, t[:k], t[k:])
        for i, (t, keep) in enumerate(zip(tokens, kept))
        if keep
        for k in range(1, len(t))
        if t[:k] in names and t[k:] in names
    ]
    found.sort()
    return [(left, right) for *_, left, right in found]
