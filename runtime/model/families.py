"""model_type -> the config and model classes that run it: the one architecture dispatch.

The config classes need no torch, so `model_args` serves `infer list` and `infer info`;
the model modules import torch, and `model_class` imports them only when asked."""

from __future__ import annotations

from importlib import import_module

from ... import InferError
from .config import FAMILIES, ModelArgs, shown
from .gemma3_config import Gemma3Args

# model_type -> (its config class, "module:class" of the nn.Module that runs it)
MODELS: dict[str, tuple[type[ModelArgs], str]] = {
    **{t: (ModelArgs, "llama:Transformer") for t in FAMILIES},
    "gemma3_text": (Gemma3Args, "gemma3:Gemma3"),
}


def model_args(cfg: dict, origin: str = "config", names: dict | None = None) -> ModelArgs:
    """The architecture numbers of a config.json-style dict, in its family's class, each
    checked: a bad one fails as "<origin>: <key> = <value>: <problem>" (see
    ModelArgs.from_dict for `names`)."""
    if not isinstance(cfg, dict):
        raise InferError(f"{origin}: not a config object ({type(cfg).__name__})")
    model_type = cfg.get("model_type", "")
    if not isinstance(model_type, str) or model_type not in MODELS:
        name = model_type or cfg.get("architectures")
        raise InferError(
            f"{origin}: unsupported architecture {shown(name)} (supported: {', '.join(MODELS)})"
        )
    return MODELS[model_type][0].from_dict(cfg, origin, names)


def model_class(args: ModelArgs) -> type:
    """The nn.Module class that runs `args` (importing torch)."""
    module, name = MODELS[args.model_type][1].split(":")
    return getattr(import_module(f".{module}", __package__), name)
