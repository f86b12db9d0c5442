"""Our checkpoint format: save and load back, metadata, atomic writes, corruption."""

import itertools
import json
import os
import struct
import subprocess
import zlib

import pytest
import torch
from tiny import make_hf_model

from infer import InferError
from infer.quant.formats.base import FORMATS, QuantEmbedding, QuantLinear
from infer.runtime.files import checkpoint
from infer.runtime.files.build import build
from infer.runtime.files.checkpoint import (
    ALIGN,
    is_checkpoint,
    read_checkpoint,
    save_checkpoint,
    verify,
)
from infer.runtime.files.sources import CheckpointSource, open_source
from infer.runtime.loader import load_model

PROMPT = [5, 77, 123, 9, 250, 31, 64, 200, 17, 3, 99, 140]
SOURCE = {"path": "/src/model", "sha256": {"model.safetensors": "0" * 64}, "format": "safetensors"}


class RowInt8(QuantLinear):
    """Test-only format: int8 weights with one float32 scale per output row."""

    format = "_test_rowint8"

    def __init__(self, qweight, scales, params, bias=None):
        super().__init__(qweight.shape[1], qweight.shape[0], params, bias)
        self.register_buffer("qweight", qweight)  # (out, in) int8
        self.register_buffer("scales", scales)  # (out,) float32

    @classmethod
    def from_float(cls, weight, bias=None, **params):
        scales = weight.float().abs().amax(1).clamp(min=1e-8) / 127
        q = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scales, params, None if bias is None else bias.detach().clone())

    def dequantize(self, rows=None):
        q, s = (
            (self.qweight, self.scales) if rows is None else (self.qweight[rows], self.scales[rows])
        )
        return q.float() * s[:, None]

    def tensors(self):
        return {"qweight": self.qweight, "scales": self.scales}

    @classmethod
    def from_tensors(cls, tensors, params, bias=None):
        return cls(tensors["qweight"], tensors["scales"], params, bias)


class RowInt8B(RowInt8):
    format = "_test_rowint8b"


@pytest.fixture(scope="module", autouse=True)
def test_formats():
    FORMATS.update({c.format: c for c in (RowInt8, RowInt8B)})
    yield
    for c in (RowInt8, RowInt8B):
        FORMATS.pop(c.format)


def swap(model, name, cls, **params):
    parent, _, child = name.rpartition(".")
    linear = model.get_submodule(name)
    setattr(
        model.get_submodule(parent), child, cls.from_float(linear.weight, linear.bias, **params)
    )


def logits(model):
    with torch.inference_mode():
        return model(torch.tensor([PROMPT]), 0, model.new_cache(), all_logits=True)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """Tied qwen2 (q/k/v bias): layer 0 quantized, lm_head quantized and shared with the
    embedding; layer 1 float. Returns (model, its checkpoint, the HF source dir)."""
    src = tmp_path_factory.mktemp("qwen2-src")
    make_hf_model("qwen2", src)
    info = open_source(src)
    model = build(info, torch.float32, 64)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        swap(model, f"layers.0.self_attn.{name}", RowInt8, bits=8)
    for name in ("gate_proj", "up_proj", "down_proj"):
        swap(model, f"layers.0.mlp.{name}", RowInt8B, bits=8, note="b")
    model.lm_head = RowInt8.from_float(model.embed_tokens.weight, bits=8)
    model.embed_tokens = QuantEmbedding(model.lm_head)
    dest = tmp_path_factory.mktemp("out") / "qwen2-q8"
    save_checkpoint(model, info.config, info.tokenizer(), dest, source=SOURCE)
    return model, dest, src


def test_round_trip_tied_quantized(qwen2):
    model, dest, _ = qwen2
    ckpt = read_checkpoint(dest)
    loaded = build(CheckpointSource(ckpt), torch.float32, 64)
    assert isinstance(loaded.lm_head, RowInt8) and loaded.embed_tokens.table is loaded.lm_head
    assert isinstance(loaded.layers[0].mlp.up_proj, RowInt8B)
    assert torch.equal(
        loaded.layers[0].self_attn.q_proj.bias, model.layers[0].self_attn.q_proj.bias
    )
    assert torch.equal(logits(loaded), logits(model))
    # Zero copy: every quantized buffer and float32 weight is a view of the file map.
    weights = [
        t for m in loaded.modules() if isinstance(m, QuantLinear) for t in m.tensors().values()
    ]
    weights += list(loaded.parameters())
    assert weights and all(ckpt.is_mapped(t) for t in weights)
    # bfloat16: float tensors converted, quantized buffers still mapped.
    bf16 = build(CheckpointSource(ckpt), torch.bfloat16, 64)
    assert bf16.layers[1].mlp.up_proj.weight.dtype == torch.bfloat16
    assert ckpt.is_mapped(bf16.layers[0].mlp.up_proj.qweight)


def test_round_trip_untied_with_rope_factors(tmp_path):
    src = tmp_path / "src"
    make_hf_model("llama", src)
    info = open_source(src)
    model = build(info, torch.float32, 64)
    swap(model, "layers.1.mlp.down_proj", RowInt8, bits=8)
    model.embed_tokens = QuantEmbedding(RowInt8.from_float(model.embed_tokens.weight, bits=8))
    model.args.rope_freq_factors = [1.0 + i / 8 for i in range(model.args.head_dim // 2)]
    model.setup_rope(64, torch.float32)  # as a Llama 3.1 GGUF load would set them
    save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "ck", source=SOURCE)
    ckpt = read_checkpoint(tmp_path / "ck")
    assert set(ckpt.quant) == {"embed_tokens.table", "layers.1.mlp.down_proj"}
    loaded = build(CheckpointSource(ckpt), torch.float32, 64)
    assert loaded.args.rope_freq_factors == model.args.rope_freq_factors
    assert loaded.lm_head.weight is not loaded.embed_tokens.table
    assert torch.equal(logits(loaded), logits(model))


def test_round_trip_tied_float(qwen2, tmp_path):
    info = open_source(qwen2[2])
    model = build(info, torch.float32, 64)
    save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "ck", source=SOURCE)
    ckpt = read_checkpoint(tmp_path / "ck")
    assert ckpt.quant == {} and ckpt.quantization == "F32"
    assert "embed_tokens.weight" in ckpt.tensors and "lm_head.weight" not in ckpt.tensors
    loaded = build(CheckpointSource(ckpt), torch.float32, 64)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))


def test_metadata_and_layout(qwen2):
    _, dest, _ = qwen2
    file = dest / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % ALIGN == 0
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert meta["format"] == "infer" and meta["format_version"] == "1"
    quant = json.loads(meta["quant"])
    assert quant["layers.0.self_attn.q_proj"] == {"format": "_test_rowint8", "bits": 8}
    assert quant["layers.0.mlp.up_proj"] == {"format": "_test_rowint8b", "bits": 8, "note": "b"}
    assert quant["lm_head"]["format"] == "_test_rowint8" and "embed_tokens.table" not in quant
    assert json.loads(meta["source"]) == SOURCE
    ranges, crcs = json.loads(meta["ranges"]), json.loads(meta["crc32"])
    assert list(ranges) == ["globals", "layers.0", "layers.1"] and set(crcs) == set(ranges)
    for unit, (b, e) in ranges.items():
        assert b % ALIGN == 0 and e <= len(data)
        assert int(crcs[unit], 16) == zlib.crc32(data[b:e])
        # The unit's tensors tile [b, e) exactly.
        spans = sorted(
            (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items()
            if checkpoint.unit_of(k) == unit and not k.startswith("__pad__")
        )
        assert spans[0][0] == b and spans[-1][1] == e
        assert all(a[1] == c[0] for a, c in itertools.pairwise(spans))
    assert "layers.0.self_attn.q_proj.bias" in header and "lm_head.weight" not in header
    assert "embed_tokens.weight" not in header  # tied: stored once, as lm_head
    # The safetensors library reads the same file.
    from safetensors import safe_open

    ckpt = read_checkpoint(dest)
    with safe_open(file, "pt") as f:
        assert f.metadata()["format"] == "infer"
        names = [k for k in f.keys() if not k.startswith("__pad__")]  # noqa: SIM118
        assert sorted(names) == sorted(ckpt.tensors)
        for name in names:
            assert torch.equal(f.get_tensor(name), ckpt.tensors[name])


def test_units_of_names():
    assert checkpoint.unit_of("embed_tokens.weight") == "globals"
    assert checkpoint.unit_of("layers.12.mlp.up_proj.qweight") == "layers.12"
    assert checkpoint.unit_of("layers.3.mlp.experts.7.up_proj.qweight") == "layers.3.mlp.experts.7"


def test_units_in_file_order(tmp_path):
    """Globals first, then layers in numeric order (layers.10 after layers.2), each
    layer's experts right after it, in numeric order too."""
    make_hf_model(  # 11 layers, every second one with 11 experts
        "qwen3_moe", tmp_path / "src", num_hidden_layers=11, num_experts=11,
        num_experts_per_tok=1, hidden_size=32, head_dim=8, moe_intermediate_size=32,
    )  # fmt: skip
    info = open_source(tmp_path / "src")
    model = build(info, torch.float32, 16)
    save_checkpoint(model, info.config, info.tokenizer(), tmp_path / "ck", source=SOURCE)
    ckpt = read_checkpoint(tmp_path / "ck")
    want = ["globals"]
    for i in range(11):
        want.append(f"layers.{i}")
        if ckpt.args.is_moe_layer(i):
            want += [f"layers.{i}.mlp.experts.{e}" for e in range(11)]
    assert len(want) == 1 + 11 + 5 * 11
    assert sorted(ckpt.ranges, key=ckpt.ranges.get) == want


def test_load_model_end_to_end(qwen2):
    model, dest, _ = qwen2
    lm = load_model(dest, torch.float32, max_seq_len=64)
    assert lm.source.format == "infer"
    assert lm.source.quantization == "mixed: _test_rowint8, _test_rowint8b"
    assert torch.equal(logits(lm.model), logits(model))
    assert lm.tokenizer.decode(lm.tokenizer.encode("hi there", add_special=False)) == "hi there"


def _save_small(model, dest, **kw):
    save_checkpoint(model, {"model_type": "llama"}, _NoTokenizer(), dest, source=SOURCE, **kw)


class _NoTokenizer:
    def save_hf(self, path):
        (path / "tokenizer.json").write_text("{}")


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_write_leaves_nothing(qwen2, tmp_path, monkeypatch, error):
    model, _, _ = qwen2
    calls, raw_bytes = [], checkpoint._raw_bytes

    def failing_raw_bytes(t):
        calls.append(1)
        if len(calls) == 5:  # mid-write, a few tensors in
            raise error
        return raw_bytes(t)

    monkeypatch.setattr(checkpoint, "_raw_bytes", failing_raw_bytes)
    with pytest.raises(type(error)):
        _save_small(model, tmp_path / "new")
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []
    # Replacing with force: the old checkpoint survives an interrupted write.
    monkeypatch.undo()
    _save_small(model, tmp_path / "old")
    monkeypatch.setattr(checkpoint, "_raw_bytes", failing_raw_bytes)
    calls.clear()
    with pytest.raises(type(error)):
        _save_small(model, tmp_path / "old", force=True)
    assert is_checkpoint(tmp_path / "old") and _leftovers(tmp_path) == []


def test_stale_temp_folders_of_dead_processes_are_removed(qwen2, tmp_path):
    model, _, _ = qwen2
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process (999999 may, where pid_max is 2**22)
    dead = tmp_path / f".ck.tmp-{child.pid}"
    live = tmp_path / f".ck.tmp-{os.getppid()}"  # our parent: alive, and not us
    other = tmp_path / ".other.tmp-999999"  # another checkpoint's: not ours to judge
    for path in (dead, live, other):
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"partial")
    _save_small(model, tmp_path / "ck")
    assert not dead.exists() and live.exists() and other.exists()
    assert is_checkpoint(tmp_path / "ck")


def test_overwrite_needs_force(qwen2, tmp_path):
    model, _, _ = qwen2
    _save_small(model, tmp_path / "ck")
    with pytest.raises(InferError, match="already exists"):
        _save_small(model, tmp_path / "ck")
    _save_small(model, tmp_path / "ck", force=True)
    assert is_checkpoint(tmp_path / "ck") and _leftovers(tmp_path) == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(InferError, match="not an infer checkpoint"):
        _save_small(model, tmp_path / "other", force=True)
    assert (tmp_path / "other" / "notes.txt").exists()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")
def test_written_weights_leave_the_page_cache(qwen2, tmp_path, monkeypatch):
    """Pages just written are small folios; let go, the first load reads them back in
    huge ones (runtime/files/hugepages.py)."""
    model, _, _ = qwen2
    dropped, fadvise = [], os.posix_fadvise

    def spy(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED and (offset, length) == (0, 0):
            dropped.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    _save_small(model, tmp_path / "ck")
    assert dropped == [checkpoint.WEIGHTS]


# -- damaged files ----------------------------------------------------------------------


@pytest.fixture
def copy(qwen2, tmp_path):
    import shutil

    return shutil.copytree(qwen2[1], tmp_path / "ck")


def _edit_metadata(dest, **changes):
    """Rewrite __metadata__ in place, within the header's space padding."""
    file = dest / "model.safetensors"
    data = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"].update(changes)
    header["__metadata__"] = {k: v for k, v in header["__metadata__"].items() if v is not None}
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    data[8 : 8 + n] = text.ljust(n)
    file.write_bytes(data)


def test_flipped_byte_is_caught(copy):
    ckpt = read_checkpoint(copy)
    b, e = ckpt.ranges["layers.1"]
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek((b + e) // 2)
        byte = f.read(1)
        f.seek((b + e) // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    verify(ckpt, ["globals", "layers.0"])  # the other units are fine
    with pytest.raises(InferError, match="unit 'layers.1' is corrupt"):
        verify(read_checkpoint(copy))
    with pytest.raises(InferError, match="unit 'layers.1' is corrupt"):
        load_model(copy)


def test_truncated_file(copy):
    file = copy / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(InferError, match="truncated"):
        read_checkpoint(copy)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"format": None}, "no infer metadata"),
        ({"format_version": "2"}, "format version '2'"),
        ({"quant": None}, "metadata 'quant'"),
        ({"crc32": "{not json"}, "metadata 'crc32'"),
        (
            {"quant": json.dumps({"lm_head": {"format": "int3"}})},
            "unknown quantization format 'int3'",
        ),
        (  # found by the fuzzer: TypeError, unhashable type
            {"quant": json.dumps({"lm_head": {"format": {"type": 1}}})},
            "unknown quantization format",
        ),
        ({"ranges": json.dumps({"globals": [4096, 10**12]})}, "outside the file"),
    ],
)
def test_bad_metadata(copy, changes, message):
    _edit_metadata(copy, **changes)
    with pytest.raises(InferError, match=message):
        read_checkpoint(copy)


def test_missing_metadata_is_not_ours(copy):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(3)}, copy / "model.safetensors")
    assert not is_checkpoint(copy)
    with pytest.raises(InferError, match="no infer metadata"):
        read_checkpoint(copy)
