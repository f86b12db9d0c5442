"""Structured output: answers that parse as JSON and validate against a schema, or follow
a llama.cpp grammar (GBNF), by constrained decoding. Each step a matcher says which tokens keep the text a prefix of a
valid document; the others' logits go to -inf before sampling.

    grammar = compile_format(tok, schema)     # or "json": any JSON object
    grammar = compile_grammar(tok, gbnf)      # or a GBNF grammar's text
    constraint = grammar.matcher()            # one per answer
    logits = constraint.mask(logits)          # before sampling
    constraint.advance(token)                 # after

llguidance does the parsing (benchmarks/README.md, "Structured output", has the figures
that chose it over xgrammar and outlines-core). Its tokenizer, built from our pieces, is
built once per Tokenizer: over a 152k vocabulary it takes about a second.
"""

from __future__ import annotations

import json
import threading
import weakref

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from .. import InferError
from .model.tokenizer import Tokenizer
from .model.tool_calls import CLOSE, OPEN

# "json": any JSON object (OpenAI's json_object, ollama's format "json").
ANY_OBJECT = {"type": "object"}

# Whitespace between JSON tokens: one newline and an indent, or spaces, as llama.cpp's JSON
# grammar allows. Unbounded whitespace (llguidance's default) lets a small model pad forever.
WHITESPACE = r"[\x20\x09]{1,20}|\x0A[\x20\x09]{0,20}"

_NEG_INF = torch.tensor(float("-inf"))

_ll_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ll_tokenizers_lock = threading.Lock()


def compile_format(tok: Tokenizer, fmt: str | dict) -> Grammar:
    """`fmt` "json" (any JSON object) or a JSON schema, compiled for `tok`'s vocabulary.
    An invalid schema raises InferError naming what is wrong."""
    if fmt == "json":
        fmt = ANY_OBJECT
    elif not isinstance(fmt, dict):
        raise InferError(f"format must be 'json' or a JSON schema object, not {fmt!r}")
    schema = {"x-guidance": {"whitespace_pattern": WHITESPACE}, **fmt}  # the schema's own wins
    try:
        source = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as err:
        raise InferError(f"invalid JSON schema: {_one_line(err)}") from None
    return _compile(tok, source, "invalid JSON schema")


def compile_grammar(tok: Tokenizer, gbnf: str) -> Grammar:
    """A llama.cpp grammar (GBNF: llama-cli's --grammar-file, llama-server's `grammar`),
    compiled for `tok`'s vocabulary through llguidance's translation to Lark. A grammar
    that does not parse raises InferError naming where."""
    try:
        lark = gbnf_to_lark(gbnf)
    except Exception as err:  # noqa: BLE001  (the translator raises plain Exceptions)
        raise InferError(f"invalid grammar: {_one_line(err)}") from None
    try:
        source = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as err:
        raise InferError(f"invalid grammar: {_one_line(err)}") from None
    return _compile(tok, source, "invalid grammar")


def compile_tool_call(tok: Tokenizer, schema: dict, tagged: bool = True) -> Grammar:
    """An answer that is one tool call (model/tool_calls.py), its object following
    `schema` (call_schema), in <tool_call> tags if `tagged`, compiled for `tok`'s
    vocabulary. The object is laid out as json.dumps does, as templates write earlier
    calls: no padding."""
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    schema = {"x-guidance": layout, **schema}
    start = f'"{OPEN}\\n" call "\\n{CLOSE}"' if tagged else "call"
    lark = f"start: {start}\ncall: %json {json.dumps(schema)}\n"
    try:
        source = llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as err:
        raise InferError(f"invalid tool parameters: {_one_line(err)}") from None
    return _compile(tok, source, "invalid tool parameters")


def _compile(tok: Tokenizer, source: str, what: str) -> Grammar:
    matcher = llguidance.LLMatcher(_ll_tokenizer(tok), source, log_level=0)
    if matcher.is_error():
        raise InferError(f"{what}: {_one_line(matcher.get_error())}")
    return Grammar(matcher, tok.vocab_size)


class Grammar:
    """A format compiled for one tokenizer; `matcher()` starts an answer under it.
    Shared by any number of answers, in any threads."""

    def __init__(self, start: llguidance.LLMatcher, vocab_size: int):
        self._start = start  # never advanced: each answer gets a copy
        self.vocab_size = vocab_size

    def matcher(self) -> Constraint:
        return Constraint(self._start.deep_copy(), self.vocab_size)


class Constraint:
    """One answer's position in the grammar. Once the document is complete, only the
    tokenizer's stop tokens are allowed, so the answer ends with finish_reason "stop"."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # the bitmask
        self._out: torch.Tensor | None = None  # the masked logits, reused

    def copy(self) -> Constraint:
        """Another answer's constraint at this one's position (before any token: the start)."""
        return Constraint(self._matcher.deep_copy(), self.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (vocab,) with the tokens the grammar forbids now at -inf; ids past the
        tokenizer's vocabulary (padded rows) are always forbidden. The result is a buffer
        of this constraint's, overwritten by the next call."""
        m = self._matcher
        m.unsafe_compute_mask_ptr(self._words.data_ptr(), 4 * self._words.numel())
        if m.is_error():
            raise InferError(f"structured output failed: {_one_line(m.get_error())}", 1)
        out = self._out
        if out is None or out.shape != logits.shape or out.dtype != logits.dtype:
            out = self._out = torch.empty_like(logits)
        return apply_bitmask(logits, self._words, out)

    def advance(self, token: int) -> None:
        """Move past `token`, which the last mask allowed."""
        if not self._matcher.consume_token(token):
            error = _one_line(self._matcher.get_error())
            raise InferError(f"structured output: token {token} is not allowed ({error})", 1)

    @property
    def done(self) -> bool:
        """The document is complete (and only stop tokens are allowed)."""
        return self._matcher.is_stopped()


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` = `logits` (vocab,) where a token's bit in `words` (W,) int32 is set, -inf
    elsewhere and past the bitmask's 32 W tokens. Bit j of byte i is token 8 i + j
    (llguidance's layout). Unpacking the bits and one `where` is the cheapest of the torch
    and numpy ways measured inside the decode loop (benchmarks/README.md)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), bitorder="little")  # (32 W,) 0 | 1
    n = min(logits.shape[-1], bits.size)
    torch.where(torch.from_numpy(bits[:n].view(np.bool_)), logits[:n], _NEG_INF, out=out[:n])
    out[n:] = float("-inf")  # embedding rows past the vocabulary
    return out


def _ll_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of `tok`, built on first use and kept while `tok` lives."""
    with _ll_tokenizers_lock:
        ll_tok = _ll_tokenizers.get(tok)
        if ll_tok is None:
            ll_tok = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Vocabulary(tok)), eos_token=sorted(tok.stop_ids)
            )
            _ll_tokenizers[tok] = ll_tok
        return ll_tok


class _Vocabulary:
    """What llguidance.TokenizerWrapper reads: each id's bytes, the special ids, an encoder.
    Stop tokens count as special even where they are ordinary text (Qwen's "</s>"), so
    the grammar never lets one into the document, where it would end the answer. It holds
    no reference to the Tokenizer, which keys the weak map its LLTokenizer is kept in."""

    def __init__(self, tok: Tokenizer):
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        self.tokens = tok.pieces
        self.special_token_ids = sorted(tok._special_ids | tok.stop_ids)
        self._encode = tok._backend.encode  # Tokenizer.encode(text, add_special=False)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text, add_special_tokens=False).ids


def _one_line(message) -> str:
    return " ".join(str(message).split())
