"""Quantize a loaded model in place, following a recipe, and report each tensor's error.

Every nn.Linear, and each nn.Embedding, whose recipe spec is not None is replaced: a
Linear by the format's QuantLinear, an Embedding by a QuantEmbedding over one. A tied
pair (the output layer's weight is the embedding's, as `runtime.files.build` ties
them) is quantized once, under the Linear's name ("lm_head"): the QuantLinear is
the output layer and the QuantEmbedding looks rows up in the same buffers.

With the model's GGUF file at hand, a tensor stored as Q8_0 / Q4_0 / Q4_1 whose recipe
asks for exactly that format (int8 g32 / int4 g32 symmetric / asymmetric) is imported
block for block (gguf_import.py) rather than requantized from its dequantized floats:
no second rounding, and it is faster.

With calibration tokens, the linear layers are quantized by GPTQ (gptq.py) against
the inputs they see on that text, block by block, each block fed through the ones
before it already quantized. Weights with no such inputs (embedding tables, a tied
output layer) and GGUF imports are quantized first, as without calibration.

With a `block_ap.BlockTraining` as well, GPTQ only gives the calibrated layers their
starting scales: each block's weights and scales are then trained to reproduce the
float block's outputs (block_ap.py). An untied output layer, outside the blocks, keeps
GPTQ's weights.

With a `tune.Tuning`, the float model first runs over its windows as the teacher, and
after quantization the scales of the blocks' linear layers that were quantized (not
imported) are trained end to end against it (tune.py). Their reports then give the
errors of the tuned weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import InferError
from ..runtime.files.gguf import GGUFFile
from ..runtime.files.gguf_blocks import from_gguf, importable
from ..runtime.files.gguf_tensor import GGUFTensor
from . import block_ap, gptq, tune
from .formats.base import FORMATS, QuantEmbedding, QuantLinear, set_module
from .formats.fit import GroupSizeError
from .formats.recipes import Recipe, spec_params

# Used instead of a spec whose group size does not divide a weight's rows, unless the spec
# names its own ("fallback", recipes.py): per-channel int8 fits any shape.
FALLBACK = {"format": "int8", "group_size": 0}


@dataclass
class TensorReport:
    name: str  # module name, e.g. "layers.3.mlp.down_proj"; a tied table reports as "lm_head"
    format: str
    params: dict
    shape: tuple[int, int]  # (out, in)
    max_abs_error: float  # against the float weight the model held
    rel_rms_error: float  # ||W_q - W|| / ||W||
    bytes_before: int
    bytes_after: int
    imported: bool = False  # GGUF blocks moved as they are, not requantized
    # GPTQ only: ||X W_q^T - X W^T|| / ||X W^T|| over the calibration inputs X (as GPTQ
    # left it, before any tuning)
    rel_output_error: float | None = None
    trained: bool = False  # weights and scales trained with their block (block_ap.py)
    tuned: bool = False  # scales trained end to end (tune.py) after quantization


def _gguf_tensor(gguf: GGUFFile, name: str, tied: bool) -> GGUFTensor | None:
    # Our module names are HF names without "model."; the output layer is "lm_head.weight",
    # and a tied output layer is the embedding table.
    if tied:
        hf = "model.embed_tokens.weight"
    else:
        hf = "lm_head.weight" if name == "lm_head" else f"model.{name}.weight"
    try:
        return gguf.hf_tensor(hf)
    except InferError:
        return None


def _imports(weight, spec: dict, source: GGUFTensor | None) -> bool:
    return (
        source is not None
        and tuple(source.shape) == tuple(weight.shape)
        and importable(source, spec)
    )


def _quantize(
    weight, bias, spec: dict, source: GGUFTensor | None, hessian: torch.Tensor | None = None
) -> tuple[QuantLinear, bool]:
    """QuantLinear for `weight` following `spec`, and whether it came from GGUF blocks.

    With `hessian` (of the layer's inputs) it is quantized by GPTQ, unless imported or
    its format has no GPTQ (int6: its own clipping search, gptq.supports)."""
    if _imports(weight, spec, source):
        return from_gguf(source, bias), True
    params = spec_params(spec)
    if spec["format"] not in FORMATS:
        raise InferError(f"unknown format {spec['format']!r} (known: {', '.join(FORMATS)})")

    def make(cls, **params):
        if hessian is None or not gptq.supports(cls):
            return cls.from_float(weight, bias, **params)
        return gptq.quantize_linear(cls, weight, bias, params, hessian)

    try:
        return make(FORMATS[spec["format"]], **params), False
    except GroupSizeError:  # the format's groups do not split the rows: its fallback
        return _quantize(weight, bias, spec.get("fallback", FALLBACK), source, hessian)


def _errors(q: QuantLinear, weight: torch.Tensor) -> tuple[float, float]:
    w = weight.float()
    diff = q.dequantize() - w
    norm = w.square().sum().item()
    err = diff.square().sum().item()
    rel = math.sqrt(err / norm) if norm > 0 else (0.0 if err == 0 else math.inf)
    return diff.abs().max().item() if diff.numel() else 0.0, rel


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    recipe: Recipe,
    *,
    gguf: GGUFFile | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    calibration: torch.Tensor | None = None,
    training: block_ap.BlockTraining | None = None,
    tuning: tune.Tuning | None = None,
) -> list[TensorReport]:
    """Replace, in place, each weight `recipe` gives a format; one report per tensor.

    `progress(name, done, total)` is called after each tensor. `calibration`: token ids,
    (n_windows, T) or (T,) (see gptq.calibration_windows), to quantize the linear layers
    by GPTQ on; `training`: to quantize them by Block-AP on it instead (block_ap.py);
    `tuning`: to then tune their scales end to end (tune.py). With any of these the
    model must be a Transformer (llama.py).
    """
    embeddings = {
        id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Embedding)
    }
    jobs = []  # (name, spec, name of the Embedding tied to it or None)
    tied_embeddings = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            tied = embeddings.get(id(m.weight))
            if tied is not None:
                tied_embeddings.add(tied)
            jobs.append((name, recipe(name), tied))
    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and name not in tied_embeddings:
            jobs.append((name, recipe(name), None))
    jobs = [job for job in jobs if job[1] is not None]

    def source_of(name: str, tied: str | None) -> GGUFTensor | None:
        return None if gguf is None else _gguf_tensor(gguf, name, tied is not None)

    targets = None
    if tuning is not None and any(
        name.startswith("layers.")
        and not _imports(model.get_submodule(name).weight, spec, source_of(name, tied))
        for name, spec, tied in jobs
    ):  # some block layer will be quantized, not imported: the float model is the teacher
        targets = tune.teacher_targets(model, tuning.windows, tuning.progress)
    reports: dict[str, TensorReport] = {}
    floats: dict[str, torch.Tensor] = {}  # float weights of the layers to train or tune

    def run(name: str, spec: dict, tied: str | None, hessian=None) -> None:
        # Look modules up by name and drop them after, so each float weight is freed as
        # soon as its replacement is in place.
        module = model.get_submodule(name)
        weight = module.weight
        bias = module.bias if isinstance(module, nn.Linear) else None
        source = source_of(name, tied)
        q, imported = _quantize(weight, bias, spec, source, hessian)
        max_abs, rel_rms = _errors(q, weight)
        out_err = None
        if hessian is not None and not imported:
            out_err = gptq.output_error(weight, q.dequantize(), hessian)
        if (
            (targets is not None or training is not None)
            and name.startswith("layers.")
            and not imported
        ):
            floats[name] = weight  # kept to report the trained or tuned weights' errors
        if isinstance(module, nn.Embedding):
            set_module(model, name, QuantEmbedding(q))
        else:
            set_module(model, name, q)
            if tied is not None:
                set_module(model, tied, QuantEmbedding(q))
        reports[name] = TensorReport(
            name,
            q.format,
            dict(q.params),
            tuple(weight.shape),
            max_abs,
            rel_rms,
            weight.numel() * weight.element_size(),
            q.nbytes,
            imported,
            out_err,
        )
        del module, weight, bias
        if progress is not None:
            progress(name, len(reports), len(jobs))

    if calibration is None:
        for job in jobs:
            run(*job)
    else:
        # GPTQ for untied linear layers that are not imported; everything else first, so
        # the calibration text runs through it as the quantized model will.
        by_name = {job[0]: job for job in jobs}
        calibrated = set()
        for name, spec, tied in jobs:
            module = model.get_submodule(name)
            source = source_of(name, tied)
            if (
                isinstance(module, nn.Linear)
                and tied is None
                and not _imports(module.weight, spec, source)
            ):
                calibrated.add(name)
        for job in jobs:
            if job[0] not in calibrated:
                run(*job)
        windows = calibration if calibration.dim() == 2 else calibration[None]
        if training is not None:
            block_ap.quantize_blocks(
                model, windows, calibrated, lambda name, H=None: run(*by_name[name], H), training
            )
            for name in calibrated & set(floats):
                reports[name].trained = True
                reports[name].rel_output_error = None  # GPTQ's, from before training
        else:
            for hessians in gptq.layer_hessians(model, windows, calibrated):
                for name, hessian in hessians.items():
                    run(*by_name[name], hessian)
        # An MoE expert the router never picked on the calibration text has no inputs to
        # fit: round it to nearest, as without calibration.
        for name in [n for n in by_name if n in calibrated and n not in reports]:
            run(*by_name[name])
    if targets is not None and floats:
        tune.tune_scales(
            model, targets, set(floats), tuning.steps, lr=tuning.lr, progress=tuning.progress
        )
        for name in floats:
            reports[name].tuned = True
    for name, weight in floats.items():  # the errors of the weights as trained or tuned
        r = reports[name]
        r.max_abs_error, r.rel_rms_error = _errors(model.get_submodule(name), weight)
    floats.clear()
    return [reports[name] for name, _, _ in jobs]


@torch.no_grad()
def dequantize_model(model: nn.Module) -> None:
    """Turn every QuantLinear / QuantEmbedding back into a float module, in place.

    Requantizing an already-quantized checkpoint starts from the weights it stands for.
    A tied table (one QuantLinear as output layer and embedding) stays one tensor.
    """
    floats: dict[int, nn.Parameter] = {}

    def weight_of(q: QuantLinear) -> nn.Parameter:
        if id(q) not in floats:
            floats[id(q)] = nn.Parameter(q.dequantize(), requires_grad=False)
        return floats[id(q)]

    for name, m in list(model.named_modules(remove_duplicate=False)):
        if isinstance(m, QuantEmbedding):
            set_module(model, name, nn.Embedding.from_pretrained(weight_of(m.table), freeze=True))
        elif isinstance(m, QuantLinear) and not name.endswith(".table"):
            linear = nn.Linear(
                m.in_features, m.out_features, bias=m.bias is not None, device="meta"
            )
            linear.weight = weight_of(m)
            if m.bias is not None:
                linear.bias = nn.Parameter(m.bias.float(), requires_grad=False)
            set_module(model, name, linear)
