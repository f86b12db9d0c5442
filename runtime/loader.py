"""Turn a model path (a GGUF file, a Hugging Face directory or our own checkpoint
directory, see checkpoint.py) into a ready Transformer.

The model is built on the meta device and the checkpoint's tensors are assigned
into it, so weights exist once: mapped straight from the file where the dtype
already matches, converted (or dequantized, for GGUF blocks) exactly once otherwise.
GGUF's quantized blocks are not dequantized but moved into our int8 / int4 layouts
(Q8_0 / Q4_0 / Q4_1 bit for bit) and run on the C kernels (see load_weights).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import InferError
from ..offload.budget import Plan
from ..offload.expert_cache import DEFAULT_POLICY
from ..offload.expert_plan import stores_experts_apart
from ..offload.expert_store import ExpertStore
from ..offload.experts import load_moe_budgeted, prediction_options
from ..offload.routing import RoutingRecorder, new_recorder
from ..offload.stream import (
    LayerStream,
    layer_costs,
    layer_units,
    load_streamed,
    overheads,
    process_rss,
)
from ..offload.trace import TraceRecorder
from ..quant.formats.base import QuantEmbedding, set_module
from .files import hugepages
from .files.checkpoint import Checkpoint, build_model, is_checkpoint, read_checkpoint, verify
from .files.gguf import GGUFFile, is_gguf
from .files.gguf_blocks import (
    ON_KERNELS,
    kernel_weights,
    loaded_bytes,
    placed_bytes,
    to_kernels,
)
from .files.safetensors import read_header, read_safetensors
from .model.config import ModelArgs
from .model.llama import Transformer
from .model.tokenizer import Tokenizer


@dataclass
class ModelInfo:
    """What a checkpoint is, read from its metadata without loading weights."""

    path: Path
    format: str  # "gguf" | "safetensors" | "infer"
    config: dict  # Hugging Face config.json-style
    args: ModelArgs
    quantization: str  # dominant weight type: "Q4_1", "BF16", "int4", "mixed: int4, int8"
    file_bytes: int
    gguf: GGUFFile | None = None  # the open reader, for a GGUF file
    checkpoint: Checkpoint | None = None  # the opened checkpoint, for our format


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    info: ModelInfo
    dtype: torch.dtype
    load_seconds: float
    # Under a memory budget (offload/): what stays resident, and the stream that reads
    # the rest (None when every layer fits).
    plan: Plan | None = None
    stream: LayerStream | None = None
    auto_budget: bool = False  # the budget was chosen because the model does not fit
    # A mixture-of-experts model under a budget: its experts served from an expert cache
    # (offload/expert_store.py; its plan covers the dense parts too, `plan` is then None).
    experts: ExpertStore | None = None
    # What the MoE blocks routed, when asked for (--trace): save with .trace().save(path).
    routing: TraceRecorder | None = None

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def model_format(path: Path) -> str:
    """Tell a GGUF file, our checkpoint and a Hugging Face directory apart by content."""
    path = Path(path)
    if path.is_dir():
        if is_checkpoint(path):
            return "infer"
        if not (path / "config.json").is_file():
            raise InferError(f"{path}: not a model directory (no config.json)")
        return "safetensors"
    if not path.exists():
        raise InferError(f"{path}: no such file or directory")
    if is_gguf(path):
        return "gguf"
    raise InferError(f"{path}: not a GGUF file or a Hugging Face model directory")


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise InferError(f"{index}: corrupt safetensors index") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InferError(f"{path}: missing weight shards {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = list(path.glob("*.bin")) + list(path.glob("*.pt"))
        hint = (
            " (pickled .bin/.pt weights are never loaded: convert to safetensors)"
            if pickles
            else ""
        )
        raise InferError(f"{path}: no .safetensors weights{hint}")
    return files


def inspect_model(path: Path) -> ModelInfo:
    """Read a checkpoint's config and weight types without touching its weights."""
    path = Path(path)
    fmt = model_format(path)
    if fmt == "gguf":
        gguf = GGUFFile(path)
        config = gguf.config()
        types = Counter(t.ggml_type.name for t in gguf.tensors.values() if len(t.shape) == 2)
        return ModelInfo(
            path,
            fmt,
            config,
            ModelArgs.from_dict(config),
            types.most_common(1)[0][0] if types else "F32",
            gguf.file_bytes,
            gguf,
        )
    if fmt == "infer":
        ckpt = read_checkpoint(path)
        return ModelInfo(
            path,
            fmt,
            ckpt.config,
            ckpt.args,
            ckpt.quantization,
            ckpt.file.stat().st_size,
            checkpoint=ckpt,
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise InferError(f"{path / 'config.json'}: invalid JSON ({e})") from None
    files = _safetensors_files(path)
    types = Counter()
    for f in files:
        header, _ = read_header(f)
        types.update(v["dtype"] for k, v in header.items() if k != "__metadata__")
    return ModelInfo(
        path,
        fmt,
        config,
        ModelArgs.from_dict(config),
        types.most_common(1)[0][0] if types else "?",
        sum(f.stat().st_size for f in files),
    )


def _state_dict(
    info: ModelInfo, dtype: torch.dtype, skip: Container[str] = ()
) -> dict[str, torch.Tensor]:
    if info.gguf is not None:
        return info.gguf.hf_state_dict(dtype, skip)
    sd = {}
    for f in _safetensors_files(info.path):
        tensors, _ = read_safetensors(f)
        sd.update(tensors)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}


def load_tokenizer(info: ModelInfo) -> Tokenizer:
    if info.gguf is not None:
        return Tokenizer.from_gguf_metadata(info.gguf.metadata)
    return Tokenizer.from_hf_dir(info.path)


def load_weights(
    info: ModelInfo, dtype: torch.dtype, max_seq_len: int | None = None, *, dequantize=False
) -> Transformer:
    """Build the Transformer on the meta device and assign the checkpoint's tensors.

    In float32, a GGUF file's quantized weights run on the int8 / int4 kernels, as
    llama.cpp runs them (quant/gguf_import.py `to_kernels`): Q8_0 / Q4_0 / Q4_1 blocks
    moved into those formats unchanged, Q4_K's codes into int4, every other quantized
    type held in int8. Float types (F16, BF16, ...), and every weight in another dtype,
    are converted to `dtype`. `dequantize`: every weight in `dtype` anyway, the exact
    float reference (`infer eval --ref`, `infer quantize`)."""
    if info.checkpoint is not None:
        return build_model(info.checkpoint, dtype, max_seq_len)
    args = info.args
    blocks = set()
    if info.gguf is not None and dtype == torch.float32 and not dequantize:
        blocks = kernel_weights(info.gguf)
        tied = args.tie_embeddings or "output.weight" not in info.gguf.tensors
        if tied:  # the output layer is the table, whatever the file holds beside it
            blocks.discard("lm_head.weight")
    sd = Transformer.sanitize(_state_dict(info, dtype, skip=blocks), args)
    with torch.device("meta"):
        model = Transformer(args)
    # The kernels' weights, copied from the file's blocks, go straight into huge pages.
    # Sized from the file's quantized tensors (a tensor not loaded this way only leaves
    # pages of the map untouched, which cost no memory).
    arena = None
    if blocks:
        quantized = [t for t in info.gguf.tensors.values() if t.ggml_type in ON_KERNELS]
        arena = hugepages.Arena.of(sum(map(placed_bytes, quantized)))
    place = arena.place if arena else torch.Tensor.contiguous
    for hf in blocks:
        t = info.gguf.hf_tensor(hf)
        name = hf.removeprefix("model.").removesuffix(".weight")
        sd.pop(f"{name}.weight", None)  # sanitize ties an lm_head it did not see to the table
        q = to_kernels(t, sd.pop(f"{name}.bias", None), place)
        info.gguf.release(t)  # copied into q: its pages need not stay in memory
        if name == "embed_tokens":
            model.embed_tokens = QuantEmbedding(q)
            if tied:  # stored once, as in our checkpoints (checkpoint.build_model)
                sd.pop("lm_head.weight", None)
                model.lm_head = q
        else:
            set_module(model, name, q)
    try:
        result = model.load_state_dict(sd, strict=False, assign=True)
    except RuntimeError as e:
        lines = str(e).strip().splitlines()
        detail = lines[1].strip() if len(lines) > 1 else lines[0]
        raise InferError(f"{info.path}: weights do not match the config: {detail}") from None
    missing = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if result.unexpected_keys or missing:
        detail = (
            f"no place for {result.unexpected_keys[0]!r}"
            if result.unexpected_keys
            else f"missing {missing[0]!r}"
        )
        raise InferError(f"{info.path}: weights do not match the config: {detail}")
    if args.tie_embeddings and isinstance(model.embed_tokens, nn.Embedding):
        model.lm_head.weight = model.embed_tokens.weight
    if arena:
        arena.close()
    model.setup_caches(min(max_seq_len or args.max_seq_len, args.max_seq_len), dtype)
    return model.eval().requires_grad_(False)


# Without --max-memory a model streams when its estimated footprint exceeds this share
# of the memory available now; the budget it then gets is a smaller share, leaving room
# for the page cache and the rest of the system.
FITS_SHARE = 0.9
AUTO_BUDGET_SHARE = 0.8


def load_model(
    path: Path,
    dtype: torch.dtype = torch.float32,
    max_seq_len: int | None = None,
    max_memory: int | None = None,
    *,
    expert_policy: str | None = None,
    record_routing: bool = False,
    expert_prediction: str | None = None,
    dequantize: bool = False,
) -> LoadedModel:
    """Load weights, tokenizer and caches. `max_seq_len` defaults to the model's context.

    `max_memory`: the process's footprint budget in bytes (RSS plus the page cache it
    holds); layers that do not fit stream from disk (offload/). Without it, a model
    too large for the available memory streams on its own, and says so on stderr.
    A mixture-of-experts model that does not fit keeps its dense parts resident and its
    experts in an expert cache of policy `expert_policy` (default: expert_cache's), read
    ahead as `expert_prediction` says (offload/experts.py PREDICTIONS; default "all").
    record_routing: record what its MoE blocks route (`LoadedModel.routing`).
    dequantize: a GGUF file's weights all in `dtype` (see load_weights).
    """
    t0 = time.perf_counter()
    process = process_rss()  # before anything of this model: torch and all
    info = inspect_model(path)
    ctx = min(max_seq_len or info.args.max_seq_len, info.args.max_seq_len)
    budget, auto = max_memory, False
    if budget is None:
        budget = _auto_budget(info, dtype, ctx, process)
        auto = budget is not None
    if budget is not None and info.checkpoint is None:
        what = "a GGUF file" if info.format == "gguf" else "a Hugging Face directory"
        advice = (
            f"streaming layers from disk needs infer's own format; convert it first: "
            f"infer quantize {info.path} -o DIR --to int8 (or int4)"
        )
        if not auto:
            raise InferError(f"{info.path} is {what}: {advice}")
        print(f"note: {info.path} may not fit in available memory; {advice}", file=sys.stderr)
        budget = None
    now = process_rss()  # what the plans count as the process (the tokenizer is small)
    if budget is not None and _offloads_experts(info.checkpoint, dtype, ctx, budget, now):
        tokenizer = load_tokenizer(info)
        ckpt = info.checkpoint
        recorder = new_recorder(ckpt.args, {"model": str(info.path)}) if record_routing else None
        model, experts = load_moe_budgeted(
            ckpt,
            dtype,
            ctx,
            budget,
            process_bytes=now,
            raise_to_minimum=auto,
            policy=expert_policy or DEFAULT_POLICY,
            recorder=recorder,
            **prediction_options(expert_prediction),
        )
        if auto:
            _say_auto_budget(info, experts.plan)
        load_s = time.perf_counter() - t0
        return LoadedModel(
            model, tokenizer, info, dtype, load_s, auto_budget=auto, experts=experts,
            routing=recorder,
        )  # fmt: skip
    if budget is not None:
        tokenizer = load_tokenizer(info)
        model, stream, plan = load_streamed(
            info.checkpoint, dtype, ctx, budget, process_bytes=now, raise_to_minimum=auto
        )
        if auto:
            _say_auto_budget(info, plan)
        load_s = time.perf_counter() - t0
        lm = LoadedModel(model, tokenizer, info, dtype, load_s, plan, stream, auto)
    else:
        if info.checkpoint is not None:
            # crc32 of every unit (~5 GB/s from the page cache): the first forward pass
            # faults these pages in anyway, and a corrupt byte fails here, naming its unit.
            verify(info.checkpoint)
        model = load_weights(info, dtype, max_seq_len, dequantize=dequantize)
        tokenizer = load_tokenizer(info)
        lm = LoadedModel(model, tokenizer, info, dtype, time.perf_counter() - t0)
    if record_routing:  # the experts are resident: hooks that only record
        lm.routing = new_recorder(info.args, {"model": str(info.path)})
        RoutingRecorder(lm.model, lm.routing)
    return lm


def _say_auto_budget(info: ModelInfo, plan) -> None:
    """The stderr note of a model streamed because it does not fit (no --max-memory)."""
    print(
        f"note: {info.path.name} does not fit in available memory: "
        f"{plan.describe()} (--max-memory sets the budget)",
        file=sys.stderr,
    )


def _offloads_experts(
    ckpt: Checkpoint | None, dtype: torch.dtype, ctx: int, budget: int, process: int
) -> bool:
    """Whether a budgeted load caches experts: a MoE checkpoint storing each expert apart
    that does not fit whole (a model that fits loads resident, as any other)."""
    if ckpt is None or not stores_experts_apart(ckpt):
        return False
    costs = layer_costs(ckpt, layer_units(ckpt, ckpt.args.n_layers), dtype)
    need = overheads(ckpt, ckpt.args, dtype, ctx, process).total
    return need + sum(c.resident_bytes for c in costs) > budget


def _auto_budget(info: ModelInfo, dtype: torch.dtype, ctx: int, process: int) -> int | None:
    """A budget when the model's estimated footprint exceeds the memory available now;
    None when it fits."""
    import psutil

    available = psutil.virtual_memory().available
    if info.checkpoint is not None:
        ckpt = info.checkpoint
        costs = layer_costs(ckpt, layer_units(ckpt, info.args.n_layers), dtype)
        fixed = overheads(ckpt, info.args, dtype, ctx, 0)
        need = fixed.total + sum(c.resident_bytes for c in costs)
    elif info.gguf is not None and dtype == torch.float32:  # as load_weights holds them
        need = sum(
            loaded_bytes(t) if t.ggml_type in ON_KERNELS else math.prod(t.shape) * 4
            for t in info.gguf.tensors.values()
        )
    else:  # HF weights, and GGUF blocks in another dtype, are converted to `dtype`
        need = info.args.n_params * dtype.itemsize
    if need <= FITS_SHARE * available:
        return None
    return process + int(AUTO_BUDGET_SHARE * available)
