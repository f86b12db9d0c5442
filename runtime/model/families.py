"""model_type -> the config and model classes that run it: the one architecture dispatch."""

from __future__ import annotations

from ... import InferError
from .config import FAMILIES, ModelArgs
from .gemma3 import Gemma3, Gemma3Args
from .llama import Transformer

MODELS: dict[str, tuple[type[ModelArgs], type]] = {
    **{t: (ModelArgs, Transformer) for t in FAMILIES},
    "gemma3_text": (Gemma3Args, Gemma3),
}


def model_args(cfg: dict) -> ModelArgs:
    """The architecture numbers of a config.json-style dict, in its family's class."""
    model_type = cfg.get("model_type", "")
    if model_type not in MODELS:
        raise InferError(
            f"unsupported architecture '{model_type or cfg.get('architectures')}'"
            f" (supported: {', '.join(MODELS)})"
        )
    return MODELS[model_type][0].from_dict(cfg)


def model_class(args: ModelArgs) -> type:
    """The nn.Module class that runs `args`."""
    return MODELS[args.model_type][1]
