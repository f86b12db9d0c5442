"""Text <-> token ids, from GGUF metadata or a Hugging Face folder, plus chat templates.

Encoding runs in the `tokenizers` library (Rust BPE): we only assemble its vocabulary,
merges, normalizer and pre-tokenizer the way llama.cpp's `src/llama-vocab.cpp` reads a
GGUF, which is the reference for what a GGUF's tokenizer means. Decoding is ours: every
id maps to the bytes it stands for (`_pieces`), so a streamed character split over two
tokens is held back until it is whole, and decode is one join.

Two GGUF tokenizer models are supported:

- "gpt2": byte-level BPE with the file's merges; the split before BPE (the
  pre-tokenizer) is chosen by `tokenizer.ggml.pre`, as llama-vocab.cpp does.
- "llama": SentencePiece BPE (Llama 2, Mistral): merges recovered from the scores,
  "▁" for spaces, <0xXX> byte tokens for characters outside the vocabulary.
"""

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.processors import TemplateProcessing

from ... import InferError
from .chat_template import CHATML_TEMPLATE, GEMMA_TEMPLATE, GEMMA_TURN_TOKENS, ChatTemplate
from .pretokenizers import FALLBACK_PRE_TOKENIZER, PRE_TOKENIZERS, byte_level_pre_tokenizer
from .special_tokens import FIM_REPO_TOKENS, FIM_TOKENS, end_ids, first_ids, kept_ids
from .spm_merges import spm_merges
from .thinking import template_thinks
from .token_pieces import byte_level_piece, sentencepiece_piece
from .tool_calls import CallFormat, call_format

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------


class Tokenizer:
    """Encode, decode, stream-decode and render chat templates for one model.

    Build with `from_gguf_metadata` or `from_hf_dir`. Attributes: vocab_size, bos_id,
    eos_id, add_bos, stop_ids (ids that end generation), chat_template (None when the
    model has none; rendering then uses ChatML, or Gemma's turns where the vocabulary has
    them), fim_ids (fill-in-the-middle's three tokens, or None).
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        pieces: list[bytes | None],
        *,
        spell: Callable[[int], bytes] | None = None,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        special_ids: frozenset[int],
        add_eos: bool = False,
        extra_stop_ids: tuple[int, ...] = (),
        chat_template: str | None = None,
        strip_leading_space: bool = False,
    ):
        self._backend = backend
        # id -> the bytes it decodes to; a None is spelled by `spell` when first asked for
        # (spelling a 262k vocabulary up front took a third of its construction).
        self._pieces = pieces
        self._spell = spell
        self._special_ids = special_ids - kept_ids(backend)  # decode(skip_special) drops them
        # SentencePiece puts a space before the text; decoding a sequence takes it off.
        self._strip_leading_space = strip_leading_space
        self.vocab_size = len(pieces)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and eos_id is not None  # an embedding model's: see encode_embedded
        self.chat_template = chat_template
        self._compiled_template = None

        stop = {*end_ids(backend), eos_id, *extra_stop_ids}
        self.stop_ids = frozenset(i for i in stop if i is not None and 0 <= i < self.vocab_size)
        self.fim_ids = first_ids(backend, FIM_TOKENS)  # (prefix, suffix, middle), or None
        self._repo_ids = first_ids(backend, FIM_REPO_TOKENS)  # (repository, file), or None

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "Tokenizer":
        """Build from a GGUF's key/values (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        kind = md.get("tokenizer.ggml.model")
        if kind == "gpt2":
            return _from_gguf_byte_level(md)
        if kind == "llama":
            return _from_gguf_sentencepiece(md)
        raise InferError(
            f"unsupported tokenizer model {kind!r} in GGUF (supported: 'gpt2', 'llama')"
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        """Build from a Hugging Face folder: tokenizer.json, tokenizer_config.json,
        generation_config.json and chat_template.jinja where present."""
        return _from_hf_dir(Path(path))

    def save_hf(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json that `from_hf_dir` reads back
        to the same tokenizer (and transformers' AutoTokenizer loads)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (path / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")

    # -- encode / decode ----------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in it ("<|im_start|>") are single
        tokens; `add_special` puts BOS in front when the model wants one."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """The text for `ids`. Ids past the vocabulary (padded embedding rows) decode to
        nothing, as in transformers. Invalid UTF-8 becomes U+FFFD."""
        data = b"".join(self._piece(i, skip_special) for i in ids)
        text = data.decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        """A decoder for generated ids, one at a time. It decodes a continuation, so it
        keeps a SentencePiece leading space that `decode` of a whole text would drop."""
        return StreamDecoder(self, skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (a special token's: its text)."""
        return self._piece(int(token_id), False)

    @property
    def pieces(self) -> list[bytes]:
        """Every id's bytes, in id order."""
        if None in self._pieces:
            self._pieces = [self._piece(i, False) for i in range(self.vocab_size)]
        return self._pieces

    def _piece(self, token_id, skip_special: bool) -> bytes:
        i = int(token_id)
        if not 0 <= i < self.vocab_size or (skip_special and i in self._special_ids):
            return b""
        piece = self._pieces[i]
        if piece is None:
            piece = self._pieces[i] = self._spell(i)
        return piece

    def _token_text(self, token_id: int | None) -> str | None:
        if token_id is None:
            return None
        return self._backend.id_to_token(token_id)

    # -- chat ---------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> str:
        """Render `messages` ({"role", "content"} dicts, an assistant's with "tool_calls")
        with the model's template, in a sandbox, with the variables transformers provides;
        `tools` as transformers passes them (OpenAI's {"type": "function", ...}), and
        `variables` of the caller's (ChatTemplate.render)."""
        if self._compiled_template is None:
            self._compiled_template = ChatTemplate(self.chat_template or self._fallback_template())
        specials = {
            name: self._token_text(token_id)
            for name, token_id in (("bos_token", self.bos_id), ("eos_token", self.eos_id))
            if token_id is not None
        }
        return self._compiled_template.render(
            messages, add_generation_prompt, tools, variables, **specials
        )

    @property
    def tool_format(self) -> CallFormat | None:
        """How the chat template asks for tool calls (tool_calls.py); None if it lists no
        tools."""
        return call_format(self.chat_template or "")

    @property
    def thinks(self) -> bool:
        """Whether the chat template is a thinking model's (thinking.py)."""
        return template_thinks(self.chat_template or "")

    def _fallback_template(self) -> str:
        """The template of a model that has none (see CHATML_TEMPLATE)."""
        gemma = all(self._backend.token_to_id(t) is not None for t in GEMMA_TURN_TOKENS)
        return GEMMA_TEMPLATE if gemma else CHATML_TEMPLATE

    def encode_embedded(self, text: str) -> list[int]:
        """A text to embed: as a prompt, and EOS after it where the model asks for one
        (an embedding model's add_eos_token: its last-token pooling reads that state).
        Generation never appends EOS."""
        return self.encode(text) + ([self.eos_id] if self.add_eos else [])

    def encode_infill(
        self, prefix: str, suffix: str, files: Sequence[tuple[str, str]] = (), middle: str = ""
    ) -> list[int]:
        """A fill-in-the-middle prompt: the code before and after the gap, for the model
        to write the middle (prefix, suffix, middle order: PSM), whose start `middle` may
        already be. `files`, (name, text) of other files for context, go before it as a
        repository, where the vocabulary has the tokens for one (as llama.cpp's infill
        lays them out); else they are left out."""
        if self.fim_ids is None:
            raise InferError("the model has no fill-in-the-middle tokens")
        pre, suf, mid = self.fim_ids
        bos = [self.bos_id] if self.add_bos else []
        repo = []
        if files and self._repo_ids is not None:
            name, sep = self._repo_ids
            repo = [name, *self.encode("project\n", False)]
            for filename, text in files:
                repo += [sep, *self.encode(f"{filename}\n{text}", False)]
            repo += [sep, *self.encode("current\n", False)]  # the file being edited
        body = [pre, *self.encode(prefix, False), suf, *self.encode(suffix, False), mid]
        return [*bos, *repo, *body, *self.encode(middle, False)]

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict | None = None,
    ) -> list[int]:
        """Render and encode a chat. BOS goes in once: where the template writes it and the
        model adds one too, the written one is dropped (what llama.cpp does)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, variables)
        bos = self._token_text(self.bos_id)
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos) :]
        return self.encode(text, add_special=True)


class StreamDecoder:
    """Turns generated ids into text as they come, holding back the bytes of a character
    that is not complete yet (an emoji spread over byte-level tokens, a <0xXX> run).

    Concatenating every `push` and then `flush` gives `Tokenizer.decode` of all the ids
    (less, for SentencePiece, the leading space `decode` drops).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pending = b""

    def push(self, token_id) -> str:
        """Add one id; return the text it completes (often "", never half a character)."""
        data = self._pending + self._tokenizer._piece(token_id, self._skip_special)
        cut = _complete_utf8_prefix(data)
        self._pending = data[cut:]
        return data[:cut].decode("utf-8", errors="replace")

    def flush(self) -> str:
        """Whatever is held back, invalid bytes as U+FFFD; the decoder starts empty again."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text


def _complete_utf8_prefix(data: bytes) -> int:
    """Length of `data` up to a trailing UTF-8 sequence that more bytes could still complete."""
    # A sequence is at most 4 bytes: look for its lead byte among the last 3.
    for back in range(1, min(3, len(data)) + 1):
        b = data[-back]
        if 0x80 <= b < 0xC0:
            continue  # continuation byte: the lead is further back
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if 0xF0 <= b < 0xF8 else 1
        return len(data) - back if need > back else len(data)
    return len(data)


# ---------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------


def _gguf_list(md: dict, key: str, kind: type, n: int | None = None, required: bool = True):
    """The GGUF array `key`: a list of `kind` (str, int or float), `n` long when given."""
    value = md.get(key)
    if value is None:
        if required:
            raise InferError(f"GGUF tokenizer metadata lacks {key}")
        return None
    kinds = {int, float} if kind is float else {kind}  # bools are not numbers here
    if not isinstance(value, list) or not set(map(type, value)) <= kinds:
        raise InferError(f"GGUF {key} is not an array of {kind.__name__}")
    if n is not None and len(value) != n:
        raise InferError(f"GGUF {key} has {len(value)} entries for {n} tokens")
    return value


def _gguf_tokens(md: dict) -> tuple[list[str], dict[str, int]]:
    """The token texts and text -> id. Like llama.cpp, empty tokens get a placeholder
    name (every id needs a distinct text) and duplicates are refused."""
    tokens = _gguf_list(md, "tokenizer.ggml.tokens", str)
    if "" in tokens:
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        raise InferError("GGUF tokenizer has duplicate tokens in its vocabulary")
    return tokens, vocab


def _gguf_types(md: dict, n_vocab: int) -> list[int]:
    types = _gguf_list(md, "tokenizer.ggml.token_type", int, n_vocab, required=False)
    return types or [NORMAL] * n_vocab


def _gguf_id(md: dict, key: str, n_vocab: int) -> int | None:
    value = md.get(f"tokenizer.ggml.{key}")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise InferError(f"GGUF tokenizer.ggml.{key} = {value!r:.40}: not a token id")
    if value is None or not 0 <= value < n_vocab:
        return None
    return value


def _bpe(**kwargs) -> _HFTokenizer:
    """A BPE tokenizer over a GGUF's vocabulary; a merge of tokens it lacks fails in one line."""
    try:
        return _HFTokenizer(models.BPE(**kwargs))
    except Exception as err:  # noqa: BLE001 (the Rust side raises a bare Exception)
        raise InferError(f"GGUF tokenizer is inconsistent: {' '.join(str(err).split())}") from None


def _add_gguf_specials(
    backend: _HFTokenizer, tokens: list[str], types: list[int]
) -> tuple[frozenset, frozenset]:
    """Make control, unknown and user-defined tokens match whole in text, as llama.cpp's
    tokenizer_st_partition does. Each is already in the vocabulary, so it keeps its id.
    Returns the ids of the special (control, unknown) and of the user-defined ones."""
    kinds = np.array(types)
    special = np.flatnonzero((kinds == CONTROL) | (kinds == UNKNOWN)).tolist()
    user = np.flatnonzero(kinds == USER_DEFINED).tolist()
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in special]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    return frozenset(special), frozenset(user)


def _spelled(backend: _HFTokenizer, plain: frozenset, spell: Callable[[str], bytes]):
    """id -> bytes: the tokens of `plain` (control, user-defined, unknown) are their text,
    the rest as `spell` reads a token. The text comes from the backend, which holds the
    vocabulary anyway (a list of its strings would be 17 MB more for Qwen's)."""

    def piece(i: int) -> bytes:
        text = backend.id_to_token(i)
        return text.encode("utf-8") if i in plain else spell(text)

    return piece


def _gguf_common(md: dict, n_vocab: int, default_add_bos: bool) -> dict:
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise InferError("GGUF tokenizer.chat_template is not a string")
    bos_id = _gguf_id(md, "bos_token_id", n_vocab)
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    end_of_turn = (_gguf_id(md, k, n_vocab) for k in ("eot_token_id", "eom_token_id"))
    return {
        "bos_id": bos_id,
        "eos_id": _gguf_id(md, "eos_token_id", n_vocab),
        "add_bos": default_add_bos if add_bos is None else bool(add_bos),
        "add_eos": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "extra_stop_ids": tuple(i for i in end_of_turn if i is not None),
        "chat_template": template,
    }


def _space_merge(m: str) -> tuple[str, ...]:
    """A merge whose left part starts with a space: split at the next space."""
    cut = m.find(" ", 1)
    return (m[:cut], m[cut + 1 :]) if cut > 0 else ()


# Lines "left right", neither part empty nor holding a space.
_SIMPLE_MERGES = re.compile(r"(?:[^ \n]+ [^ \n]+\n)*[^ \n]+ [^ \n]+")


def _merge_pairs(merges: list[str]) -> list[tuple[str, ...]]:
    """Each merge "left right" as (left, right). llama.cpp splits at the first space
    after the first character, so a left part that is itself a space still parses."""
    # Nearly always every merge is two non-empty parts around one space: then one split
    # of them all. The lines matching, one pair a merge, means no merge holds a newline.
    joined = "\n".join(merges)
    if _SIMPLE_MERGES.fullmatch(joined):
        parts = joined.replace("\n", " ").split(" ")
        if len(parts) == 2 * len(merges):
            return list(zip(parts[0::2], parts[1::2]))
    pairs = [tuple(m.split(" ", 1)) if m[:1] != " " else _space_merge(m) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise InferError(f"GGUF tokenizer has a malformed merge {bad!r}")
    return pairs


def _from_gguf_byte_level(md: dict) -> Tokenizer:
    tokens, vocab = _gguf_tokens(md)
    merges = _gguf_list(md, "tokenizer.ggml.merges", str)
    types = _gguf_types(md, len(tokens))
    pre = md.get("tokenizer.ggml.pre") or FALLBACK_PRE_TOKENIZER
    if not isinstance(pre, str):
        raise InferError(f"GGUF tokenizer.ggml.pre = {pre!r:.40}: not a name")
    splits, ignore_merges = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS[FALLBACK_PRE_TOKENIZER])

    backend = _bpe(vocab=vocab, merges=_merge_pairs(merges), ignore_merges=ignore_merges)
    backend.pre_tokenizer = byte_level_pre_tokenizer(splits)
    backend.decoder = decoders.ByteLevel()
    special_ids, user_ids = _add_gguf_specials(backend, tokens, types)

    # llama.cpp turns BOS on for these pre-tokenizers unless the file says otherwise.
    default_add_bos = pre in ("llama3", "llama-v3", "llama-bpe", "tekken", "chameleon")
    tok = Tokenizer(
        backend,
        [None] * len(tokens),
        spell=_spelled(backend, special_ids | user_ids, byte_level_piece),
        special_ids=special_ids,
        **_gguf_common(md, len(tokens), default_add_bos),
    )
    _set_bos_post_processor(tok)
    return tok


def _from_gguf_sentencepiece(md: dict) -> Tokenizer:
    tokens, vocab = _gguf_tokens(md)
    scores = _gguf_list(md, "tokenizer.ggml.scores", float, len(tokens))
    types = _gguf_types(md, len(tokens))
    unk_id = _gguf_id(md, "unknown_token_id", len(tokens))

    backend = _bpe(
        vocab=vocab,
        merges=spm_merges(tokens, scores, np.isin(types, (NORMAL, USER_DEFINED))),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    # Spaces become "▁" and, with add_space_prefix, each run of text gets one in front:
    # at the start and after every special token, as llama.cpp and SentencePiece do. A
    # normalizer, not Metaspace: Metaspace adds no "▁" to text that starts with a space,
    # so " Hi" would lose one ("▁Hi" rather than "▁▁Hi").
    add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    replace = normalizers.Replace(" ", "▁")
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace])
    else:
        backend.normalizer = replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    special_ids, user_ids = _add_gguf_specials(backend, tokens, types)

    tok = Tokenizer(
        backend,
        [None] * len(tokens),
        spell=_spelled(backend, special_ids | user_ids, sentencepiece_piece),
        special_ids=special_ids,
        strip_leading_space=add_space_prefix,
        **_gguf_common(md, len(tokens), default_add_bos=True),
    )
    _set_bos_post_processor(tok)
    return tok


def _set_bos_post_processor(tok: Tokenizer) -> None:
    """Put BOS in the backend's post-processor too, so a saved tokenizer.json adds it in
    transformers as it does here (our own encode adds it itself)."""
    if tok.add_bos:
        bos = tok._token_text(tok.bos_id)
        tok._backend.post_processor = TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise InferError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise InferError(f"{path}: not a JSON object")
    return value


def _token_content(config: dict, name: str, where: Path) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    value = config.get(name)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise InferError(f"{where}: {name} = {value!r:.40}: not a token")
    return value


def _token_ids(value, name: str, where: Path) -> list[int]:
    """generation_config.json's eos_token_id: one id or a list of them."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InferError(f"{where}: {name} = {value!r:.40}: not token ids")
    return ids


def _decoder_types(spec: dict | None) -> list[dict]:
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [d for sub in spec.get("decoders", []) for d in _decoder_types(sub)]
    return [spec]


def _from_hf_dir(path: Path) -> Tokenizer:
    file = path / "tokenizer.json"
    if not file.is_file():
        raise InferError(f"{path}: no tokenizer.json")
    try:
        backend = _HFTokenizer.from_file(str(file))
    except Exception as err:  # the Rust side raises a bare Exception for a bad file
        raise InferError(f"{file}: cannot read tokenizer ({err})") from err
    config = _read_json(path / "tokenizer_config.json")
    generation = _read_json(path / "generation_config.json")

    # How ids turn back into bytes follows from the decoder.
    decoder = backend.decoder
    steps = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
    kinds = {d.get("type") for d in steps}
    replaces_metaspace = any(
        d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in steps
    )
    if "ByteLevel" in kinds:
        spell, strip = byte_level_piece, False
    elif "Metaspace" in kinds or "ByteFallback" in kinds or replaces_metaspace:
        spell = sentencepiece_piece
        strip = any(d.get("type") == "Strip" and d.get("start", 0) > 0 for d in steps) or any(
            d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never"
            for d in steps
        )
    else:
        raise InferError(f"{file}: unsupported tokenizer decoder {sorted(k for k in kinds if k)}")

    # Added tokens are plain text; ids the file skips (rare) decode to nothing.
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    vocab = backend.get_vocab(with_added_tokens=True)
    pieces = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        pieces[i] = token.encode("utf-8") if i in added else spell(token)
    special_ids = frozenset(i for i, t in added.items() if t.special)

    def token_id(name: str) -> int | None:
        text = _token_content(config, name, path / "tokenizer_config.json")
        return backend.token_to_id(text) if text else None

    gen_eos = _token_ids(
        generation.get("eos_token_id"), "eos_token_id", path / "generation_config.json"
    )
    bos_id = token_id("bos_token")
    if (
        bos_id is None
        and isinstance(generation.get("bos_token_id"), int)
        and "bos_token" not in config
    ):
        bos_id = generation["bos_token_id"]
    eos_id = token_id("eos_token")
    if eos_id is None and gen_eos:
        eos_id = gen_eos[0]
    # As a GGUF's: an id outside the vocabulary is no id (encode would put it in).
    bos_id, eos_id = (
        i if i is not None and 0 <= i < len(pieces) else None for i in (bos_id, eos_id)
    )

    # Without a flag, the tokenizer.json's post-processor says whether it adds BOS (or
    # EOS: an embedding model's, Qwen3-Embedding's).
    with_special = backend.encode("a", add_special_tokens=True).ids
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = bos_id is not None and with_special[:1] == [bos_id]
    add_eos = config.get("add_eos_token")
    if add_eos is None:
        add_eos = eos_id is not None and with_special[-1:] == [eos_id]

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise InferError(f"{path / 'tokenizer_config.json'}: chat_template is not a string")
    template_file = path / "chat_template.jinja"
    if template_file.is_file():  # transformers prefers the separate file
        template = template_file.read_text(encoding="utf-8")

    return Tokenizer(
        backend,
        pieces,
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
        special_ids=special_ids,
        extra_stop_ids=tuple(gen_eos),
        chat_template=template,
        strip_leading_space=strip,
    )
