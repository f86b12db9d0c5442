"""model_type -> the config and model classes that run it: the one architecture dispatch."""

from __future__ import annotations

from ... import InferError
from .config import FAMILIES, ModelArgs, shown
from .gemma3 import Gemma3, Gemma3Args
from .llama import Transformer

MODELS: dict[str, tuple[type[ModelArgs], type]] = {
    **{t: (ModelArgs, Transformer) for t in FAMILIES},
    "gemma3_text": (Gemma3Args, Gemma3),
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
    """The nn.Module class that runs `args`."""
    return MODELS[args.model_type][1]
