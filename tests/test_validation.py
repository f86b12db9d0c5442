"""Absurd or inconsistent model files fail before anything is built, in one InferError
line naming the key and the value; chat templates render within a time and size limit.
The files are the fuzzer's small bases (fuzz_loaders.py), each with one thing wrong."""

from __future__ import annotations

import json
import struct
import time

import fuzz_loaders as fz
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from infer import InferError
from infer.runtime.files.model_file import open_model_file
from infer.runtime.loader import load_model
from infer.runtime.model import chat_template
from infer.runtime.model.chat_template import ChatTemplate
from infer.runtime.model.config import ModelArgs


def gguf_file(tmp_path, edit, kind: str = "llama"):
    g = fz.gguf_base(kind, np.random.default_rng(0))
    edit(g)
    path = tmp_path / "m.gguf"
    path.write_bytes(fz.write_gguf(g))
    return path


def set_kv(key: str, value, vtype: int | None = None):
    def edit(g):
        kv = g.kv(key)
        if kv is None:
            g.kvs.append([key, vtype, value])
        else:
            kv[1:] = [vtype or kv[1], value]

    return edit


def tensor_of(g, name: str) -> fz.Tensor:
    return next(t for t in g.tensors if t.name == name)


def retype(name: str, ttype: int, keep_data: bool):
    """`name` stored as `ttype`: its values encoded again, or its bytes kept as they are."""

    def edit(g):
        t = tensor_of(g, name)
        if not keep_data:
            t.data = fz.encode(fz._decode(t).reshape(list(reversed(t.dims))), ttype)
        t.ttype = int(ttype)

    return edit


def reshape(name: str, shape: tuple[int, ...]):
    """`name` replaced by a tensor of another shape, in its type: a consistent file."""

    def edit(g):
        t = tensor_of(g, name)
        t.dims, t.data = list(reversed(shape)), fz.encode(np.zeros(shape, np.float32), t.ttype)

    return edit


def assert_fails(path, *words: str, seconds: float = 5.0) -> None:
    t0 = time.monotonic()
    with pytest.raises(InferError) as err:
        load_model(path, max_seq_len=32)
    message = str(err.value)
    assert "\n" not in message
    for w in words:
        assert w in message, message
    assert time.monotonic() - t0 < seconds


# A tensor whose shape disagrees with the config, in a file consistent otherwise.
SHAPES = [
    (reshape("blk.0.attn_q.weight", (32, 64)), ["q_proj.weight' has shape (32, 64)", "(64, 64)"]),
    (reshape("blk.1.ffn_norm.weight", (65,)), ["post_attention_layernorm", "(65,)"]),
    (reshape("token_embd.weight", (100, 64)), ["embed_tokens", "(100, 64)", "(262, 64)"]),
    (reshape("rope_freqs.weight", (4,)), ["rope_freqs.weight has shape (4,)", "needs (8,)"]),
    (reshape("blk.1.attn_k.weight", (16, 2, 64)), ["k_proj.weight' has shape (16, 2, 64)"]),
]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        # The hang: every layer counted over 2**32 layers.
        (set_kv("llama.block_count", 0xFFFFFFFF), ["llama.block_count = 4294967295", "2 blocks"]),
        (set_kv("llama.block_count", 1), ["llama.block_count = 1", "2 blocks"]),
        (set_kv("llama.block_count", 2.0, fz.F32), ["llama.block_count = 2.0"]),
        (set_kv("llama.rope.freq_base", float("nan")), ["llama.rope.freq_base = nan"]),
        (set_kv("llama.attention.layer_norm_rms_epsilon", 3.0), ["rms_epsilon = 3.0"]),
        (set_kv("llama.attention.layer_norm_rms_epsilon", 0.0), ["rms_epsilon = 0.0"]),
        # Both run, as another model: the fuzzer's outputs that changed without a word.
        (set_kv("llama.attention.layer_norm_rms_epsilon", 1e-30), ["rms_epsilon = 1e-30"]),
        (set_kv("llama.rope.freq_base", 2.0), ["freq_base = 2.0: must be at least 100"]),
        (set_kv("llama.attention.head_count", 3), ["head_count_kv = 2: does not divide 3"]),
        (set_kv("llama.attention.head_count_kv", 0), ["head_count_kv = 0: must be 1 to 4"]),
        (set_kv("llama.attention.key_length", 15, fz.U32), ["key_length = 15: is odd"]),
        (set_kv("llama.embedding_length", "x", fz.STR), ["embedding_length = 'x'"]),
        (set_kv("llama.context_length", 2**40, fz.U64), ["context_length = 1099511627776"]),
        (set_kv("llama.rope.scaling.type", "linear", fz.STR), []),  # no factor: no scaling
        (set_kv("general.alignment", 48), ["power of two"]),
        *SHAPES,
        # Retyped with the data kept: fewer bytes than the tensors' layout holds.
        (retype("blk.0.attn_norm.weight", T.F16, keep_data=True), ["no tensor holds"]),
        (retype("blk.1.attn_q.weight", T.Q4_0, keep_data=True), ["no tensor holds"]),
        (retype("blk.0.attn_norm.weight", T.I32, keep_data=False), ["cannot be of type I32"]),
        (retype("blk.0.ffn_norm.weight", T.Q8_0, keep_data=False), ["cannot be of type Q8_0"]),
    ],
)
def test_bad_gguf_fails_before_building(tmp_path, edit, words):
    path = gguf_file(tmp_path, edit)
    if not words:
        load_model(path, max_seq_len=32)
        return
    assert_fails(path, *words)


@pytest.mark.parametrize(("edit", "words"), SHAPES)
def test_bad_shapes_fail_on_the_header_alone(tmp_path, edit, words):
    """What `infer info` reads (model_file.py, no torch) refuses them as loading does."""
    with pytest.raises(InferError) as err:
        open_model_file(gguf_file(tmp_path, edit))
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value


def test_gguf_data_past_the_end_and_bad_rope_factors(tmp_path):
    def offset(g):
        tensor_of(g, "output_norm.weight").offset = 2**40

    assert_fails(gguf_file(tmp_path, offset), "truncated", "output_norm.weight")

    def zero_factor(g):
        t = tensor_of(g, "rope_freqs.weight")
        t.data = fz.encode(np.array([0, *range(1, 8)], np.float32), T.F32)

    assert_fails(gguf_file(tmp_path, zero_factor), "rope_freqs[0] = 0.0")


def test_gguf_tokenizer_token_flipped_against_its_merges(tmp_path):
    def flip(g):
        etype, tokens = g.kv("tokenizer.ggml.tokens")[2]
        g.kv("tokenizer.ggml.tokens")[2] = (etype, [t if t != "he" else "hx" for t in tokens])

    assert_fails(gguf_file(tmp_path, flip), "m.gguf: GGUF tokenizer is inconsistent", "he")

    def scores_short(g):
        etype, scores = g.kv("tokenizer.ggml.scores")[2]
        g.kv("tokenizer.ggml.scores")[2] = (etype, scores[:-1])

    words = ["tokenizer.ggml.scores has 267 entries for 268 tokens"]
    assert_fails(gguf_file(tmp_path, scores_short, "qwen2"), *words)


def test_gguf_tokenizer_larger_than_the_embedding(tmp_path):
    def fewer_rows(g):
        set_kv("llama.vocab_size", 200, fz.U32)(g)
        reshape("token_embd.weight", (200, 64))(g)
        reshape("output.weight", (200, 64))(g)

    assert_fails(gguf_file(tmp_path, fewer_rows), "262 tokens", "200 rows")


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            set_kv("qwen3moe.expert_used_count", 9),
            ["qwen3moe.expert_used_count = 9: must be 1 to 8"],
        ),
        (set_kv("qwen3moe.expert_count", 0xFFFFFFFF), ["expert_count = 4294967295"]),
        # Found by the fuzzer: 4096 experts built on the meta device took 20 s to refuse.
        (set_kv("qwen3moe.expert_count", 4096), ["expert_count = 4096", "router", "8 rows"]),
        (reshape("blk.1.ffn_up_exps.weight", (7, 32, 64)), ["experts.7", "missing"]),
    ],
)
def test_bad_moe_gguf(tmp_path, edit, words):
    assert_fails(gguf_file(tmp_path, edit, "qwen3moe"), *words)


# ---------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------


def test_hf_expert_count_is_the_routers(tmp_path):
    path = tmp_path / "moe"
    fz.write_hf(path, "qwen2_moe", np.random.default_rng(0))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_experts": 4096}))
    assert_fails(path, "num_experts = 4096", "mlp.gate.weight has 8 rows", seconds=2)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    fz.write_hf(path, "llama", np.random.default_rng(0))
    return path


def hf_copy(base, tmp_path, config=None, raw_config=None, tensors=None, header=None):
    """A copy of the base folder with its config.json or model.safetensors changed."""
    path = tmp_path / "m"
    path.mkdir(parents=True)
    for f in base.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    if config is not None:
        cfg = json.loads((base / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config}))
    if raw_config is not None:
        (path / "config.json").write_bytes(raw_config)
    if tensors is not None:
        (path / "model.safetensors").write_bytes(fz.safetensors_bytes(tensors))
    if header is not None:
        data = (base / "model.safetensors").read_bytes()
        h, _ = fz._read_safetensors_header(data)
        header(h)
        (path / "model.safetensors").write_bytes(fz._with_header(data, h, keep_size=True))
    return path


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"raw_config": b"[]"}, ["config.json: not a config object (list)"]),
        ({"raw_config": b"null"}, ["not a config object"]),
        ({"raw_config": b"5"}, ["not a config object"]),
        ({"raw_config": b'{"model_type": "llama\xff"}'}, ["config.json: invalid JSON"]),
        ({"raw_config": b"[" * 100000}, ["config.json: invalid JSON"]),
        ({"config": {"num_hidden_layers": 2**32}}, ["num_hidden_layers = 4294967296: must be 1"]),
        ({"config": {"num_hidden_layers": 3}}, ["num_hidden_layers = 3", "hold 2 layers"]),
        ({"config": {"hidden_size": float("inf")}}, ["hidden_size = inf: must be an integer"]),
        ({"config": {"intermediate_size": -5}}, ["intermediate_size = -5"]),
        ({"config": {"vocab_size": 2**63}}, ["vocab_size = 9223372036854775808"]),
        ({"config": {"tie_word_embeddings": "false"}}, ["tie_word_embeddings = 'false'"]),
        ({"config": {"model_type": ["llama"]}}, ["unsupported architecture ['llama']"]),
        ({"config": {"rope_scaling": {"rope_type": "linear", "factor": "x"}}}, ["factor = 'x'"]),
        ({"config": {"rope_scaling": {"rope_type": "linear", "factor": 0}}}, ["factor = 0"]),
        ({"config": {"rope_scaling": [1, 2]}}, ["rope_scaling = [1, 2]: must be an object"]),
        # A scaling that does not say which, or leaves a number out: once a silent default.
        ({"config": {"rope_scaling": {"factor": 8.0}}}, ["factor = 8.0: given with no rope_type"]),
        ({"config": {"rope_scaling": {"rope_type": "linear"}}}, ["missing rope_scaling.factor"]),
        (
            {
                "config": {
                    "rope_scaling": {
                        **fz.HF_CONFIGS["llama"]["rope_scaling"],
                        "high_freq_factor": 1,
                    }
                }
            },
            ["high_freq_factor = 1"],
        ),
        ({"config": {"eos_token_id": "x"}}, ["eos_token_id = 'x'"]),
        (
            {"config": {"intermediate_size": 95}},
            ["down_proj.weight' has shape (64, 96)", "(64, 95)"],
        ),
    ],
)
def test_bad_config_json(hf_base, tmp_path, change, words):
    assert_fails(hf_copy(hf_base, tmp_path, **change), *words)


def _entry(name, value):
    def edit(h):
        h[name] = value

    return edit


def test_bad_safetensors(hf_base, tmp_path):
    name = "model.layers.0.input_layernorm.weight"
    entry = json.loads(
        json.dumps(
            fz._read_safetensors_header((hf_base / "model.safetensors").read_bytes())[0][name]
        )
    )
    b, e = entry["data_offsets"]
    cases = [
        (_entry(name, "x"), "corrupt entry for tensor 'model.layers.0.input_layernorm.weight'"),
        (_entry(name, {"shape": entry["shape"], "data_offsets": [b, e]}), "corrupt entry"),
        (_entry(name, {**entry, "shape": [2**64]}), "size mismatch"),
        (_entry(name, {**entry, "dtype": "F16", "data_offsets": [b, b + (e - b) // 2]}), "hole"),
    ]
    for i, (edit, words) in enumerate(cases):
        assert_fails(hf_copy(hf_base, tmp_path / str(i), header=edit), words)


def test_integer_weights_are_refused(hf_base, tmp_path):
    weights = fz.hf_weights(fz.HF_CONFIGS["llama"], np.random.default_rng(0))
    weights["model.norm.weight"] = weights["model.norm.weight"].astype(np.int32)
    assert_fails(hf_copy(hf_base, tmp_path, tensors=weights), "model.norm.weight", "I32")


def test_checkpoint_float_retyped_as_integer(hf_base, tmp_path):
    # Found by the fuzzer: same size, so the crc32 of the data still matched, and the
    # table loaded as int32 and answered.
    path = tmp_path / "ck"
    fz.write_checkpoint(path, hf_base)
    data = (path / "model.safetensors").read_bytes()
    header, _ = fz._read_safetensors_header(data)
    header["embed_tokens.weight"]["dtype"] = "I32"
    (path / "model.safetensors").write_bytes(fz._with_header(data, header, keep_size=True))
    assert_fails(path, "'embed_tokens.weight' is torch.int32, not a float type")


def test_from_dict_names_keys_by_origin():
    with pytest.raises(InferError, match=r"^f.gguf: llama.block_count = 0: must be 1 to 1024$"):
        ModelArgs.from_dict(
            {**fz.HF_CONFIGS["llama"], "num_hidden_layers": 0},
            "f.gguf",
            {"num_hidden_layers": "llama.block_count"},
        )


# ---------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]


def test_template_that_loops_for_ever_stops_in_time(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    t0 = time.monotonic()
    with pytest.raises(InferError, match="takes more than 0.3 s to render"):
        ChatTemplate(fz.TEMPLATES[1]).render(HI)  # 10^10 empty iterations
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize(
    "source",
    [
        "{{ 'x' * 10000000000 }}",
        "{{ (messages * 1000000000)|length }}",
        "{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x ~ s.x %}{% endfor %}",
        "{% set s = namespace(x='ab') %}{% for i in range(40) %}{% set s.x = s.x + s.x %}{% endfor %}",
        "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
        "{{ 'x'|center(10000000000) }}",
        "{{ 'x'.ljust(10000000000) }}",
        "{{ '%99999999999s' % 'x' }}",
        "{{ '{:>99999999999}'.format('x') }}",
        "{{ 2 ** 100000000000 }}",
    ],
)
def test_template_that_renders_gigabytes_fails_at_once(source):
    t0 = time.monotonic()
    with pytest.raises(InferError, match="more than"):
        ChatTemplate(source).render(HI)
    assert time.monotonic() - t0 < 2


def test_limits_leave_ordinary_templates_alone():
    source = (
        "{% for m in messages %}{% if loop.first %}[{{ loop.length }}]{% endif %}"
        "{{ '%s: %s' % (m.role, m.content) }}{{ '{:>3}'.format(loop.index) }}{% endfor %}"
        "{% for x in range(3) if x > 0 %}{{ x ~ '-' }}{% endfor %}"
    )
    assert ChatTemplate(source).render(HI * 2) == "[2]user: Hi  1user: Hi  21-2-"


def test_gguf_file_with_a_runaway_template(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    path = gguf_file(tmp_path, set_kv("tokenizer.chat_template", fz.TEMPLATES[0]))
    lm = load_model(path, max_seq_len=32)
    with pytest.raises(InferError, match="to render"):
        lm.tokenizer.encode_chat(HI)


def test_the_gguf_key_struct_layout_is_what_the_fuzzer_patches(tmp_path):
    """fuzz_loaders patches the real model's numbers in place at the offsets it finds;
    check it finds them where GGUFFile reads them."""
    from infer.runtime.files.gguf import GGUFFile

    path = gguf_file(tmp_path, lambda g: None)
    spots = {k: at for k, _, at in fz._real_scalars(path)}
    at = spots["llama.block_count"]
    assert (
        struct.unpack_from("<I", path.read_bytes(), at)[0]
        == GGUFFile(path).metadata["llama.block_count"]
    )


@pytest.mark.slow  # two `infer` processes
def test_damaged_file_is_one_line_through_the_cli(tmp_path):
    from test_cli import assert_one_line_error, infer

    path = gguf_file(tmp_path, set_kv("llama.block_count", 0xFFFFFFFF))
    words = ["llama.block_count = 4294967295", "tensors for 2 blocks"]
    assert_one_line_error(infer("run", path, "Hi"), 2, *words)
    assert_one_line_error(infer("info", path), 2, *words)
    path = gguf_file(tmp_path, retype("blk.0.attn_norm.weight", T.F16, keep_data=True))
    assert_one_line_error(infer("info", path), 2, "no tensor holds")
    path = gguf_file(tmp_path, reshape("blk.0.attn_q.weight", (32, 64)))
    assert_one_line_error(infer("info", path), 2, "q_proj.weight' has shape (32, 64)")
