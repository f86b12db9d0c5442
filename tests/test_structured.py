"""Structured output (runtime/structured.py): answers under a JSON schema parse and
validate, on the real default model and on a tiny random one (whose logits favour no
format at all, so only the mask keeps its output valid); bad schemas are one-line errors."""

import gc
import json
import os
import re
import subprocess
import sys
import weakref

import jsonschema
import pytest
import torch
from tiny import make_hf_model

from infer import InferError
from infer.runtime.answer import stream_answer
from infer.runtime.generate import make_sampler
from infer.runtime.loader import load_model
from infer.runtime.model.tokenizer import Tokenizer
from infer.runtime.session import Session
from infer.runtime.structured import _ll_tokenizer, compile_format, compile_grammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ASK = "Describe a made-up person as JSON: name, age, favourite colour and a few tags."


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_model(smollm2_gguf, torch.float32, max_seq_len=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random smollm2-shaped model: one token per byte (259), embeddings padded to 320.
    It pads with much of the whitespace the grammar allows, a byte a token: a long context."""
    path = tmp_path_factory.mktemp("structured") / "tiny"
    make_hf_model("smollm2", path, max_position_embeddings=512)
    return load_model(path)


def answer(lm, fmt, temperature=0.0, seed=None, max_tokens=200, prompt=ASK):
    tok = lm.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    constraint = compile_format(tok, fmt).matcher()
    sampler = make_sampler(temperature, seed=seed)
    return stream_answer(
        Session(lm.model), tok, ids, sampler, max_tokens, lambda _: None, constraint=constraint
    )


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1), (1.0, 2)])
def test_real_model_answers_validate(smollm2, temperature, seed):
    a = answer(smollm2, PERSON, temperature, seed)
    assert a.finish_reason == "stop", a.text  # ended by the grammar, on a stop token
    jsonschema.validate(json.loads(a.text), PERSON)


def test_json_mode_gives_an_object(smollm2):
    a = answer(smollm2, "json", prompt="What is the capital of France? Answer in JSON.")
    assert a.finish_reason == "stop", a.text
    assert isinstance(json.loads(a.text), dict)


# Greedy, the random model takes all the whitespace allowed (~500 tokens): compact JSON,
# as the schema's own options may ask.
COMPACT = {"x-guidance": {"whitespace_flexible": False}, **PERSON}


@pytest.mark.parametrize("fmt, temperature, seed", [(COMPACT, 0.0, None), (PERSON, 1.0, 3)])
def test_random_model_answers_validate(tiny, fmt, temperature, seed):
    a = answer(tiny, fmt, temperature, seed, max_tokens=450)
    assert a.finish_reason == "stop", a.text
    jsonschema.validate(json.loads(a.text), PERSON)
    if fmt is COMPACT:
        assert not any(c.isspace() for c in a.text)


def test_unconstrained_random_model_is_not_json(tiny):
    # What the tests above would see without the mask: the check can fail.
    tok = tiny.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": ASK}])
    a = stream_answer(Session(tiny.model), tok, ids, make_sampler(0.0), 60, lambda _: None)
    with pytest.raises(json.JSONDecodeError):
        json.loads(a.text)


# A llama.cpp grammar (GBNF): a date, then a word from a list.
DATE_GBNF = r"""
root ::= date " " mood
date ::= [0-9]{4} "-" [01] [0-9] "-" [0-3] [0-9]
mood ::= "calm" | "busy" | "stormy"
"""
DATE = re.compile(r"[0-9]{4}-[01][0-9]-[0-3][0-9] (calm|busy|stormy)")


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 4)])
def test_gbnf_grammar_answers_follow_it(tiny, smollm2, temperature, seed):
    """An answer under a GBNF grammar (llguidance's translation) is a sentence of it,
    ended by the grammar; the unconstrained random model's is not."""
    for lm in (tiny, smollm2):
        tok = lm.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": "Today's date and mood?"}])
        constraint = compile_grammar(tok, DATE_GBNF).matcher()
        a = stream_answer(
            Session(lm.model), tok, ids, make_sampler(temperature, seed=seed), 40,
            lambda _: None, constraint=constraint,
        )  # fmt: skip
        assert a.finish_reason == "stop" and DATE.fullmatch(a.text), a.text
    ids = tiny.tokenizer.encode_chat([{"role": "user", "content": "Today's date and mood?"}])
    free = stream_answer(
        Session(tiny.model), tiny.tokenizer, ids, make_sampler(0.0), 15, lambda _: None
    )
    assert not DATE.fullmatch(free.text)


@pytest.mark.parametrize(
    "gbnf, words",
    [("root ::= foo", "foo"), ('x ::= "a"', "root"), ('root ::= "a" (', "Expected")],
)
def test_bad_gbnf_grammar_names_the_problem(tiny, gbnf, words):
    with pytest.raises(InferError, match="invalid grammar") as err:
        compile_grammar(tiny.tokenizer, gbnf)
    assert words in str(err.value)


def test_mask_allows_only_stop_tokens_when_complete(smollm2):
    tok = smollm2.tokenizer
    constraint = compile_format(tok, {"type": "object"}).matcher()
    vocab = smollm2.model.args.vocab_size
    for i, token in enumerate(tok.encode('{"a": [1, "x"]}', add_special=False)):
        allowed = constraint.mask(torch.zeros(vocab)).isfinite().nonzero().flatten().tolist()
        assert token in allowed
        assert not set(allowed) & tok.stop_ids  # never inside the document
        if i == 0:  # no leading whitespace: "{", '{"', ...
            assert all(tok.decode([t]).startswith("{") for t in allowed)
        constraint.advance(token)
    assert constraint.done
    allowed = constraint.mask(torch.zeros(vocab)).isfinite().nonzero().flatten()
    assert set(allowed.tolist()) == tok.stop_ids


def test_mask_keeps_allowed_logits_and_forbids_padded_rows(tiny):
    tok = tiny.tokenizer
    logits = torch.randn(tiny.model.args.vocab_size)
    assert logits.numel() > tok.vocab_size  # the embedding is padded past the tokenizer
    constraint = compile_format(tok, {"type": "string"}).matcher()
    constraint.advance(tok.encode('"', add_special=False)[0])
    masked = constraint.mask(logits)
    allowed = masked.isfinite()
    assert 100 < allowed.sum() < tok.vocab_size  # inside a string: most bytes
    assert torch.equal(masked[allowed], logits[allowed])
    assert not allowed[tok.vocab_size :].any()
    newline, letter = (tok.encode(c, add_special=False)[0] for c in "\na")
    assert allowed[letter] and not allowed[newline]  # JSON strings escape control bytes


def test_advance_refuses_a_forbidden_token(tiny):
    tok = tiny.tokenizer
    constraint = compile_format(tok, {"type": "integer"}).matcher()
    with pytest.raises(InferError, match="not allowed"):
        constraint.advance(tok.encode("x", add_special=False)[0])


def test_the_library_tokenizer_is_built_once_per_tokenizer(smollm2, tiny):
    compile_format(smollm2.tokenizer, "json")
    first = _ll_tokenizer(smollm2.tokenizer)
    compile_format(smollm2.tokenizer, PERSON)
    assert _ll_tokenizer(smollm2.tokenizer) is first
    # and is dropped with it (a server unloading a model frees both)
    tok = Tokenizer.from_hf_dir(tiny.source.path)
    compile_format(tok, "json")
    gone = weakref.ref(tok)
    del tok
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize(
    "fmt, words",
    [
        ({"type": "strin"}, ["invalid JSON schema", "strin"]),
        ({"type": "object", "required": "name"}, ["invalid JSON schema", "required"]),
        ({"type": "string", "pattern": "[a-"}, ["invalid JSON schema", "unclosed"]),
        ({"type": "integer", "minimum": 5, "maximum": 1}, ["minimum (5)", "maximum (1)"]),
        ({"$ref": "#/$defs/missing"}, ["invalid JSON schema", "missing"]),
        ("yaml", ["format must be 'json' or a JSON schema"]),
        (["json"], ["format must be 'json' or a JSON schema"]),
    ],
)
def test_invalid_schema_is_a_one_line_error(tiny, fmt, words):
    with pytest.raises(InferError) as err:
        compile_format(tiny.tokenizer, fmt)
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    for word in words:
        assert word in message


# -------------------------------------------------------------------------------- CLI


def infer_run(*args, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "INFER_DEBUG"}
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", "run", *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**base, "HF_HUB_OFFLINE": "1", **env},
        timeout=120,
    )


def test_cli_format_schema(smollm2_gguf, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = infer_run(smollm2_gguf, ASK, "--format", schema, "--temp", "0", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["finish_reason"] == "stop"
    jsonschema.validate(json.loads(data["text"]), PERSON)


def test_cli_bad_format_file_is_exit_2(smollm2_gguf, tmp_path):
    # All fail before the model loads.
    (tmp_path / "not.json").write_text("type: object\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    for name, words in [
        ("missing.json", ["cannot read the schema", "No such file"]),
        ("not.json", ["not valid JSON"]),
        ("list.json", ["a JSON schema is an object"]),
    ]:
        r = infer_run(smollm2_gguf, "Hi", "--format", tmp_path / name)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: --format {tmp_path / name}")
        for word in words:
            assert word in lines[0]


@pytest.mark.slow  # loads the model in a child
def test_cli_invalid_schema_is_exit_2(smollm2_gguf, tmp_path):
    schema = tmp_path / "bad.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "strin"}}}')
    r = infer_run(smollm2_gguf, "Hi", "--format", schema)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["error: invalid JSON schema: Invalid type: strin"]
