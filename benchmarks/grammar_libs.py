"""Structured output: llguidance, xgrammar and outlines-core on our vocabularies.

For each GGUF: build each library's tokenizer object from ours, compile a typical JSON
schema and "any JSON object", then generate greedily under the schema on the real model,
timing per token the library's bitmask fill, applying it to the logits (the same
runtime.structured.apply_bitmask for all three) and advancing the matcher. The forward
pass is timed too, for scale.

    pip install --no-deps xgrammar apache-tvm-ffi outlines-core   # not dependencies
    python benchmarks/grammar_libs.py MODEL.gguf [MODEL.gguf ...] [--tokens 48]

outlines-core has no recursive grammar: its "any JSON object" is a regex nested a few
levels deep, whose index over the vocabulary is slow (--skip-outlines-any skips it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance
import outlines_core
import torch
import xgrammar

from infer.runtime.generate import make_sampler
from infer.runtime.loader import load_model
from infer.runtime.session import Session
from infer.runtime.structured import apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}
ANY_OBJECT = {"type": "object"}
PROMPT = "Describe a made-up person as JSON: name, age, favourite colour and a few tags."


# ----------------------------------------------------------------------------- libraries


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        self.words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        class Wrapper:  # what llguidance.TokenizerWrapper reads
            eos_token_id, bos_token_id = tok.eos_id, tok.bos_id
            tokens = tok.pieces + [b""] * (vocab - tok.vocab_size)
            special_token_ids = sorted(tok._special_ids | tok.stop_ids)

            def __call__(self, text):
                text = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
                return tok._backend.encode(text, add_special_tokens=False).ids

        self.tok = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(Wrapper()), eos_token=sorted(tok.stop_ids)
        )

    def compile(self, schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, m):
        m.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        return self.words

    def advance(self, m, token):
        assert m.consume_token(token), m.get_error()

    def done(self, m):
        return m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        # Special tokens as empty pieces: xgrammar then never lets them into the text.
        specials = tok._special_ids | tok.stop_ids
        pieces = [b"" if i in specials else p for i, p in enumerate(tok.pieces)]
        self.info = xgrammar.TokenizerInfo(
            pieces, vocab_size=vocab, stop_token_ids=sorted(tok.stop_ids)
        )
        self.words = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        return xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, m):
        m.fill_next_token_bitmask(self.words)
        return self.words[0]

    def advance(self, m, token):
        assert m.accept_token(token)

    def done(self, m):
        return m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab):
        by_piece: dict[bytes, list[int]] = {}
        for i, piece in enumerate(tok.pieces):
            if i not in tok._special_ids and i not in tok.stop_ids:
                by_piece.setdefault(piece, []).append(i)
        self.vocab = outlines_core.Vocabulary(tok.eos_id, by_piece)
        self.words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, schema):
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        return outlines_core.Guide(outlines_core.Index(regex, self.vocab))

    def fill(self, m):
        m.write_mask_into(self.words.data_ptr(), self.words.numel(), 4)
        return self.words

    def advance(self, m, token):
        m.advance(token, return_tokens=False)

    def done(self, m):
        return m.is_finished()


# ----------------------------------------------------------------------------- measuring


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def generate(lm, lib, matcher, prompt, n_tokens, stop_ids):
    """Greedy under the schema; per-token seconds of fill, apply, advance and forward."""
    session = Session(lm.model)
    greedy = make_sampler(temperature=0)
    logits = session.prefill(prompt)
    masked = torch.empty_like(logits)
    fills, applies, advances, forwards, out = [], [], [], [], []
    for _ in range(n_tokens):
        with session.threads.forward():  # torch's ops on one thread, as in generate()
            words, t_fill = timed(lib.fill, matcher)
            t0 = time.perf_counter()
            logits = apply_bitmask(logits, words, masked)
            applies.append(time.perf_counter() - t0)
            token = greedy(logits)
        fills.append(t_fill)
        if token in stop_ids:
            break
        out.append(token)
        advances.append(timed(lib.advance, matcher, token)[1])
        logits, t_forward = timed(session.step, token)
        forwards.append(t_forward)
    return out, fills, applies, advances, forwards


def us(xs):
    return f"{1e6 * statistics.mean(xs):.0f}" if xs else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--skip-outlines-any", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    for path in args.models:
        lm = load_model(path, torch.float32, max_seq_len=512)
        tok, vocab = lm.tokenizer, lm.model.args.vocab_size
        prompt = tok.encode_chat([{"role": "user", "content": PROMPT}])
        print(f"\n{path.name}: vocab {vocab}")
        header = "library | tokenizer s | schema ms | any-object ms | first mask us"
        print(header + " | fill us/tok | apply us/tok | advance us/tok | forward us/tok | tokens")
        for cls in (LLGuidance, XGrammar, OutlinesCore):
            lib, t_tok = timed(cls, tok, vocab)
            matcher, t_schema = timed(lib.compile, SCHEMA)
            t_any = None
            if not (cls is OutlinesCore and args.skip_outlines_any):
                t_any = timed(lib.compile, ANY_OBJECT)[1]
            out, fills, applies, advances, forwards = generate(
                lm, lib, matcher, prompt, args.tokens, tok.stop_ids
            )
            text = tok.decode(out)
            print(
                f"{lib.name} | {t_tok:.2f} | {1e3 * t_schema:.1f} | "
                f"{'-' if t_any is None else f'{1e3 * t_any:.0f}'} | {us(fills[:1])} | "
                f"{us(fills[1:])} | {us(applies)} | {us(advances)} | {us(forwards)} | {len(out)}"
            )
            print(f"    {text!r}")


if __name__ == "__main__":
    main()
