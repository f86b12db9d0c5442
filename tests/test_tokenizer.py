"""Tokenizer: the default model's GGUF tokenizer against transformers' conversion of the
same file, SentencePiece vocabularies against the `sentencepiece` library, chat templates
against transformers' renderer, and the sandbox against hostile templates."""

import io
import json
import random
import time
from pathlib import Path

import pytest
from real_files import pulled
from tiny import write_tokenizer
from tokenizers import Tokenizer as HFBackend
from tokenizers import pre_tokenizers

from infer import InferError
from infer.runtime.files.gguf import GGUFFile
from infer.runtime.model import spm_merges as spm_module
from infer.runtime.model.pretokenizers import PRE_TOKENIZERS
from infer.runtime.model.token_pieces import byte_level_piece, sentencepiece_piece
from infer.runtime.model.tokenizer import Tokenizer, _merge_pairs, _space_merge

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # fast\n\n\nprint(square(12))\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "12345",
    "pi is 3.14159, e is 2.71828; 1,000,000 and 0042",
    "Version 2.0.1-rc3 was released on 2024-12-31.",
    "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nwindows\r\n",
    "multiple    spaces    inside",
    "don't you'll I'M we've THEY'RE",
    "Unicode: café, naïve, Ünïcödé, Ελληνικά, русский",
    "中文测试，日本語のテキスト、한국어 문장",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_start|>",
    "<|im_star not special",
    "",
    " ",
    "\n",
    "a" * 200,
]

# SmolLM2's own tokenizer.json splits every digit off (Digits(individual_digits=True)
# before ByteLevel), and llama.cpp's "smollm" pre-tokenizer does the same (its regexes
# "\p{N}" then GPT-2's). transformers' GGUF converter has no entry for "smollm" and uses
# plain GPT-2 splitting, which keeps a space glued to a non-ASCII numeral (" ½"). We
# follow llama.cpp; the oracle below gets SmolLM2's real pre-tokenizer put back.
DIGIT_DISAGREEMENT = "1 ½ cups and x ²"

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another, with an emoji 😀?"},
]


# ---------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metadata(smollm2_gguf) -> dict:
    return GGUFFile(smollm2_gguf).metadata


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf):
    """transformers' tokenizer converted from the same GGUF, as the file describes it."""
    transformers = pytest.importorskip("transformers")
    path = Path(smollm2_gguf)
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def oracle(hf_gguf) -> HFBackend:
    """The converted backend with SmolLM2's real pre-tokenizer (see DIGIT_DISAGREEMENT)."""
    backend = HFBackend.from_str(hf_gguf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


# ---------------------------------------------------------------------------------------
# The default model (byte-level BPE, pre-tokenizer "smollm")
# ---------------------------------------------------------------------------------------


def test_build_is_fast(metadata):
    # 49152 tokens and 48900 merges; measured ~0.1 s on the 2-core dev box.
    best = min(_timed(lambda: Tokenizer.from_gguf_metadata(metadata)) for _ in range(2))
    assert best < 1.0, f"building the tokenizer took {best:.2f} s"


def test_attributes(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    assert tok.chat_template.startswith("{% for message in messages %}")


def test_encode_matches_transformers(tok, oracle):
    for text in TEXTS + [DIGIT_DISAGREEMENT]:
        assert tok.encode(text) == oracle.encode(text).ids, text


def test_digit_split_follows_llama_cpp(tok, hf_gguf):
    # Known-good ids (llama.cpp-compatible implementations of "smollm" agree on these).
    assert tok.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert tok.encode("  multiple   spaces") == [216, 2701, 256, 5600]
    # transformers' converter differs where a space meets a non-ASCII numeral.
    ours = tok.encode(DIGIT_DISAGREEMENT)
    assert ours[:4] == [33, 216, 16738, 12382]  # "1", " ", "½", " cups"
    assert hf_gguf.encode(DIGIT_DISAGREEMENT, add_special_tokens=False) != ours


def test_special_tokens_are_single_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2:] == [2, 198]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_star") != [1]


def test_decode_round_trips(tok, hf_gguf):
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids) == hf_gguf.decode(ids)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special=True) == "user\nhi"
    assert tok.decode([tok.vocab_size + 5]) == ""  # a padded embedding row


def test_stream_decoder_equals_decode(tok):
    for text in TEXTS:
        ids = tok.encode(text)
        stream = tok.stream_decoder()
        parts = [stream.push(i) for i in ids]
        assert "".join(parts) + stream.flush() == tok.decode(ids)
        assert not any("\ufffd" in p for p in parts), text


def test_stream_decoder_holds_back_split_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) == 3  # the emoji's 4 bytes span three byte-level tokens
    stream = tok.stream_decoder()
    parts = [stream.push(i) for i in ids]
    assert parts[:-1] == [""] * (len(ids) - 1) and parts[-1] == "😀"
    # An unfinished character is flushed as U+FFFD.
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"


def test_stop_ids(tok):
    assert {0, 2} <= tok.stop_ids  # <|endoftext|>, <|im_end|> (also EOS)
    assert 1 not in tok.stop_ids


# ---------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------


def test_chat_template_matches_transformers(tok, hf_gguf):
    for messages in (MESSAGES, MESSAGES[1:]):  # the second gets the template's default system
        for add in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=add)
            theirs = hf_gguf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add
            )
            assert ours == theirs
    ids = tok.encode_chat(MESSAGES)
    theirs = hf_gguf.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    assert ids == list(theirs["input_ids"])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")


def _with_template(metadata, template) -> Tokenizer:
    return Tokenizer.from_gguf_metadata({**metadata, "tokenizer.chat_template": template})


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('touch /tmp/infer_pwned') }}",
        "{% set ns = namespace(__class__=1) %}{{ ns }}",
    ],
)
def test_hostile_template_raises(metadata, template):
    with pytest.raises(InferError) as err:
        _with_template(metadata, template).apply_chat_template(MESSAGES)
    assert "\n" not in str(err.value)
    assert not Path("/tmp/infer_pwned").exists()


def test_template_errors_are_one_line(metadata):
    with pytest.raises(InferError, match="no system role"):
        _with_template(metadata, "{{ raise_exception('no system role') }}").apply_chat_template([])
    with pytest.raises(InferError, match="does not parse"):
        _with_template(metadata, "{% for %}").apply_chat_template([])
    with pytest.raises(InferError, match="chat template failed"):
        _with_template(metadata, "{{ 1 + 'a' }}").apply_chat_template([])


def test_template_helpers(metadata):
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ ns.n }}|{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}"
    )
    out = _with_template(metadata, template).apply_chat_template([{"role": "u", "content": "<é>"}])
    assert out == '{"role": "u", "content": "<é>"}1|<|im_start|>|<|im_end|>|4'


def test_no_template_falls_back_to_chatml(metadata):
    md = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.chat_template is None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_no_template_with_gemma_turn_tokens_falls_back_to_gemma():
    """A vocabulary with Gemma's turn tokens and no template renders Gemma's turns: the
    system prompt before the first user text, "assistant" as "model"."""
    md = _spm_metadata()
    for piece in ("<start_of_turn>", "<end_of_turn>"):
        md["tokenizer.ggml.tokens"] = [*md["tokenizer.ggml.tokens"], piece]
        md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"], 3]
        md["tokenizer.ggml.scores"] = [*md["tokenizer.ggml.scores"], 0.0]
    tok = Tokenizer.from_gguf_metadata(md)
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello "},
        {"role": "user", "content": "bye"},
    ]
    assert tok.apply_chat_template(chat) == (
        "<s><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert tok.apply_chat_template(chat[1:2], add_generation_prompt=False) == (
        "<s><start_of_turn>user\nhi<end_of_turn>\n"
    )
    assert len(md["tokenizer.ggml.tokens"]) - 1 in tok.stop_ids  # <end_of_turn> ends a turn


def test_encode_chat_does_not_double_bos(metadata):
    md = {**metadata, "tokenizer.ggml.add_bos_token": True}
    md["tokenizer.chat_template"] = "{{ bos_token }}{{ messages[0]['content'] }}"
    tok = Tokenizer.from_gguf_metadata(md)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == [1, *tok.encode("hi", add_special=False)]
    assert tok.encode("hi")[0] == 1


# ---------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------


def test_fill_in_the_middle(tok, tmp_path):
    """A vocabulary with FIM tokens (Qwen2.5-Coder's spelling) lays out prefix, suffix,
    middle; its FIM pad and file separator end an answer; the default model has none."""
    write_tokenizer(tmp_path, ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"))
    fim = Tokenizer.from_hf_dir(tmp_path)
    pre, suf, mid = fim.fim_ids
    assert fim.encode_infill("ab", "c") == [pre, *fim.encode("ab"), suf, *fim.encode("c"), mid]
    assert fim.encode_infill("ab", "c", middle="d") == fim.encode_infill("ab", "c") + fim.encode(
        "d"
    )
    # other files go before it only where the vocabulary can name a repository's files
    assert fim.encode_infill("ab", "c", [("x.py", "y")]) == fim.encode_infill("ab", "c")
    assert fim._backend.token_to_id("<|fim_pad|>") in fim.stop_ids
    assert tok.fim_ids is None
    with pytest.raises(InferError, match="no fill-in-the-middle"):
        tok.encode_infill("a", "b")


def test_fill_in_the_middle_with_other_files(tmp_path):
    """Other files as a repository before the FIM prompt (Qwen2.5-Coder's repo-level
    layout, as llama.cpp's infill writes it): the repository's name, then each file's
    name and text after a separator, then a separator for the file being edited."""
    fim_tokens = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    write_tokenizer(tmp_path, (*fim_tokens, "<|repo_name|>", "<|file_sep|>"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    repo, sep = (tok._backend.token_to_id(t) for t in ("<|repo_name|>", "<|file_sep|>"))
    files = [("a.py", "x = 1"), ("b.py", "y = 2")]
    want = [repo, *tok.encode("project\n"), sep, *tok.encode("a.py\nx = 1"), sep]
    want += [*tok.encode("b.py\ny = 2"), sep, *tok.encode("current\n")]
    assert tok.encode_infill("p", "s", files) == want + tok.encode_infill("p", "s")


def test_save_hf_round_trip(tok, tmp_path):
    tok.save_hf(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + [DIGIT_DISAGREEMENT]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text)) == text
    assert back.vocab_size == tok.vocab_size
    assert (back.bos_id, back.eos_id, back.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
    assert back.stop_ids == tok.stop_ids
    assert back.chat_template == tok.chat_template
    assert back.apply_chat_template(MESSAGES) == tok.apply_chat_template(MESSAGES)


def test_saved_dir_loads_in_transformers(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save_hf(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    assert hf.apply_chat_template(MESSAGES, tokenize=False) == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=False
    )


def test_hf_dir_extras(tok, tmp_path):
    tok.save_hf(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["add_bos_token"]  # then the post-processor decides (it adds nothing here)
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config_path.write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    back = Tokenizer.from_hf_dir(tmp_path)
    assert back.add_bos is False and back.eos_id == 2
    assert back.stop_ids == tok.stop_ids | {7}
    assert back.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_hf_dir_errors(tmp_path):
    with pytest.raises(InferError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InferError, match="cannot read tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unsupported_model():
    with pytest.raises(InferError, match="unsupported tokenizer model 'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert"})


# ---------------------------------------------------------------------------------------
# Pre-tokenizer table
# ---------------------------------------------------------------------------------------


def _byte_vocab_metadata(pre: str) -> dict:
    """A byte-level vocabulary with one token per byte, no merges, and ChatML specials."""
    tokens = ["<|im_start|>", "<|im_end|>", *sorted(pre_tokenizers.ByteLevel.alphabet())]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * (len(tokens) - 2),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.eos_token_id": 1,
    }


# One name for each distinct entry (the table maps many names to each), and one unknown.
_PRE_EXAMPLES = {(tuple(splits), ignore): name for name, (splits, ignore) in PRE_TOKENIZERS.items()}


@pytest.mark.parametrize("pre", [*_PRE_EXAMPLES.values(), "no-such-pre"])
def test_every_pre_tokenizer_builds(pre):
    tok = Tokenizer.from_gguf_metadata(_byte_vocab_metadata(pre))
    text = "<|im_start|>Héllo 12345 wörld's 中文 😀\n\n  x<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 0 and ids[-1] == 1 and tok.decode(ids) == text
    assert tok.stop_ids == {1}


def test_merges_split_at_the_first_space_after_the_first_character():
    md = _byte_vocab_metadata("qwen2")
    md["tokenizer.ggml.tokens"] += ["ab", " ", "  ", " b"]
    md["tokenizer.ggml.token_type"] += [1] * 4
    md["tokenizer.ggml.merges"] = ["a b", "   ", "  b"]  # a left part that is a space
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"])
    for bad in ["ab", "", " "]:
        md["tokenizer.ggml.merges"] = ["a b", bad]
        with pytest.raises(InferError, match=f"malformed merge {bad!r}"):
            Tokenizer.from_gguf_metadata(md)


def test_merge_pairs_of_the_default_model(metadata):
    merges = metadata["tokenizer.ggml.merges"]
    one_by_one = [tuple(m.split(" ", 1)) if m[:1] != " " else _space_merge(m) for m in merges]
    assert _merge_pairs(merges) == one_by_one
    assert len(one_by_one) == 48900


def _eager_pieces(md: dict, spell) -> list[bytes]:
    """Every id's bytes, spelled up front as the tokenizer once built them."""
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    return [t.encode() if types[i] in (2, 3, 4) else spell(t) for i, t in enumerate(tokens)]


def test_lazy_pieces_equal_eager_ones(metadata):
    """Pieces are spelled on first use, in any order: the same bytes as spelled up front,
    and, where they are whole characters, what tokenizers' ByteLevel decoder makes."""
    eager = _eager_pieces(metadata, byte_level_piece)
    tok = Tokenizer.from_gguf_metadata(metadata)
    some = list(range(len(eager) - 1, 0, -97))
    assert [tok._piece(i, False) for i in some] == [eager[i] for i in some]
    assert tok.decode(range(0, len(eager), 5)) == b"".join(eager[::5]).decode(errors="replace")
    assert tok.pieces == eager and len(eager) == 49152
    decoder = tok._backend.decoder
    tokens = metadata["tokenizer.ggml.tokens"]
    for i in range(0, len(eager), 3):
        if metadata["tokenizer.ggml.token_type"][i] == 1 and eager[i].isascii():
            assert decoder.decode([tokens[i]]).encode() == eager[i], tokens[i]


# ---------------------------------------------------------------------------------------
# SentencePiece ("llama" tokenizer model)
# ---------------------------------------------------------------------------------------

# Byte tokens <0x00>..<0xFF> at ids 3..258, then pieces with SentencePiece-style scores
# (a piece's merge is preferred the higher its score).
SPM_PIECES = [
    ("▁", -1.0),
    ("h", -2.0),
    ("e", -2.0),
    ("l", -2.0),
    ("o", -2.0),
    ("w", -2.0),
    ("r", -2.0),
    ("d", -2.0),
    ("ll", -3.0),
    ("ld", -3.5),
    ("▁h", -4.0),
    ("▁he", -5.0),
    ("llo", -6.0),
    ("▁hello", -7.0),
    ("▁w", -8.0),
    ("or", -9.0),
    ("▁wor", -10.0),
    ("▁world", -11.0),
    ("<tool>", 0.0),
]


def _spm_metadata(**overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for piece, score in SPM_PIECES:
        tokens.append(piece)
        types.append(4 if piece == "<tool>" else 1)
        scores.append(score)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    md.update(overrides)
    return md


def test_sentencepiece_synthetic():
    tok = Tokenizer.from_gguf_metadata(_spm_metadata())
    ids = {piece: i + 259 for i, (piece, _) in enumerate(SPM_PIECES)}
    assert tok.add_bos and tok.bos_id == 1 and tok.stop_ids == {2}
    assert tok.encode("hello world") == [1, ids["▁hello"], ids["▁world"]]
    # A leading space is kept as its own "▁", as SentencePiece and llama.cpp do.
    assert tok.encode(" hello", add_special=False) == [ids["▁"], ids["▁hello"]]
    # "é" is not in the vocabulary: its UTF-8 bytes become byte tokens.
    assert tok.encode("hé", add_special=False) == [ids["▁h"], 3 + 0xC3, 3 + 0xA9]
    # Special and user-defined tokens match whole; the text after them gets its "▁".
    assert tok.encode("hello</s>world<tool>hello", add_special=False) == [
        ids["▁hello"],
        2,
        ids["▁world"],
        ids["<tool>"],
        ids["▁hello"],
    ]
    for text in ("hello world", " hello  world ", "hé wörld\n"):
        assert tok.decode(tok.encode(text, add_special=False)) == text
        assert tok.decode(tok.encode(text), skip_special=True) == text
    # The "▁" put before text after a special token decodes as a space (llama.cpp and
    # Llama 2's own tokenizer.json, whose normalizer prepends per segment, agree).
    assert tok.decode(tok.encode("a<tool>b", add_special=False)) == "a<tool> b"
    assert tok.decode(tok.encode("hello")) == "<s> hello"  # as transformers renders it

    stream = tok.stream_decoder()
    parts = [stream.push(i) for i in tok.encode("hello hé", add_special=False)]
    assert parts == [" hello", " h", "", "é"]  # a continuation keeps its leading space

    no_prefix = Tokenizer.from_gguf_metadata(
        _spm_metadata(**{"tokenizer.ggml.add_space_prefix": False})
    )
    assert no_prefix.encode("hello", add_special=False)[0] == ids["h"]
    assert no_prefix.decode(no_prefix.encode(" hello", add_special=False)) == " hello"


def test_sentencepiece_lazy_pieces_equal_eager_ones():
    md = _spm_metadata()
    tok = Tokenizer.from_gguf_metadata(md)
    eager = _eager_pieces(md, sentencepiece_piece)
    assert [tok._piece(i, False) for i in range(len(eager) - 1, -1, -1)] == eager[::-1]
    assert eager[3 + 0xC3] == b"\xc3" and eager[-1] == b"<tool>"


@pytest.mark.parametrize("base, at_once", [(None, None), (1, None), (None, 5)])
def test_spm_merges_match_the_reference(monkeypatch, base, at_once):
    """The vectorized recovery of merges against the plain one on random vocabularies:
    ties in score, tokens that take no part, multi-byte characters. Base 1 makes
    anagrams hash alike, which sends some to the reference and others through the
    full comparison; a few characters at once makes many runs of comparisons."""
    if base is not None:
        monkeypatch.setattr(spm_module._SubstringHash, "BASE", base)
    if at_once is not None:
        monkeypatch.setattr(spm_module, "_AT_ONCE", at_once)
    rng = random.Random(7)
    for alphabet in ("ab", "ab▁é中😀x"):
        tokens = list({"".join(rng.choices(alphabet, k=rng.randint(1, 7))) for _ in range(4000)})
        rng.shuffle(tokens)
        kept = [rng.random() < 0.7 for _ in tokens]
        scores = [float(rng.randint(-30, 0)) for _ in tokens]
        merges = spm_module.spm_merges(tokens, scores, kept)
        assert merges == spm_module.spm_merges_reference(tokens, scores, kept)
        assert len(merges) > len(tokens) // 4


def test_spm_merges_compare_parts_in_full(monkeypatch):
    """With base 1 a hash is the sum of the characters: "ba" hashes as the token "ab" and
    must not make ("c", "ba") a merge."""
    monkeypatch.setattr(spm_module._SubstringHash, "BASE", 1)
    reference = spm_module.spm_merges_reference
    monkeypatch.setattr(spm_module, "spm_merges_reference", None)  # not taken
    tokens, kept, scores = ["a", "b", "c", "ab", "cba"], [True] * 5, [0.0, 0.0, 0.0, -1.0, -2.0]
    assert spm_module.spm_merges(tokens, scores, kept) == [("a", "b")]
    assert reference(tokens, scores, kept) == [("a", "b")]


GEMMA3 = pulled("gemma3-270m", "INFER_TEST_GEMMA3")


@pytest.mark.slow
def test_gemma3_merges_and_pieces():
    """Gemma 3's 262,144 tokens: the same 514,847 merges, in the same order, as the plain
    recovery; the same pieces as spelled up front."""
    if GEMMA3 is None or not GEMMA3.is_file():
        pytest.skip("Gemma 3 270M is not here: `infer pull gemma3-270m`, or set INFER_TEST_GEMMA3")
    md = GGUFFile(GEMMA3).metadata
    tokens, scores = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"]
    kept = [t in (1, 4) for t in md["tokenizer.ggml.token_type"]]  # normal, user-defined
    merges = spm_module.spm_merges(tokens, scores, kept)
    assert len(merges) == 514847 and merges == spm_module.spm_merges_reference(tokens, scores, kept)
    tok = Tokenizer.from_gguf_metadata(md)
    assert tok.pieces == _eager_pieces(md, sentencepiece_piece)


def test_sentencepiece_missing_scores():
    md = _spm_metadata()
    del md["tokenizer.ggml.scores"]
    with pytest.raises(InferError, match="tokenizer.ggml.scores"):
        Tokenizer.from_gguf_metadata(md)


def test_sentencepiece_matches_sentencepiece(tmp_path):
    """A BPE model trained by the sentencepiece library (as Llama 2's was), converted to
    GGUF-style metadata, encodes and decodes like the library itself."""
    spm = pytest.importorskip("sentencepiece")
    corpus = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
    if not corpus.is_file():
        pytest.skip(f"no training text at {corpus}")
    lines = [line for line in corpus.read_text().splitlines()[:8000] if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines[:6000]),
        model_writer=model,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",  # Llama 2's settings
        remove_extra_whitespaces=False,
        split_digits=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        for i in range(n)
    ]
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    tok = Tokenizer.from_gguf_metadata(md)
    texts = lines[6000:] + [" two leading", "trailing  ", "a\nb\n\nc", "naïve café 😀 中文 ½"]
    for text in texts:
        ids = tok.encode(text, add_special=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text

    tok.save_hf(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for text in texts[:200]:
        assert back.encode(text) == tok.encode(text)
        assert back.decode(tok.encode(text), skip_special=True) == text


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_tags_an_answer_is_read_by_are_never_skipped(tmp_path):
    """Tool-call and thought tags stay in a decoded answer even where the file marks them
    special (Qwen's <tool_call>, Mistral's [TOOL_CALLS], <think>); other specials go."""
    tags = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<think>", "</think>")
    write_tokenizer(tmp_path, extra=(*tags, "[INST]"))
    tok = Tokenizer.from_hf_dir(tmp_path)
    text = "[INST]<think>hm</think>[TOOL_CALLS] [1]<tool_call>x</tool_call>"
    assert tok.decode(tok.encode(text), skip_special=True) == text.replace("[INST]", "")
