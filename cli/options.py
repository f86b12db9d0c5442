"""Options shared by the commands, as `Annotated` aliases (huggingface_hub's `_cli_utils.py`).

Only typer and the standard library are imported here: `infer --help` must not pay
for torch.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer


class DType(str, Enum):
    """Compute dtype for the weights and the KV cache."""

    float32 = "float32"
    bfloat16 = "bfloat16"


class KVCache(str, Enum):
    """The KV cache's format (runtime/model/kvcache.py)."""

    f32 = "f32"
    bf16 = "bf16"
    int8 = "int8"


class ExpertPolicy(str, Enum):
    """Which cached expert a mixture-of-experts model evicts (offload/expert_cache.py)."""

    lru = "lru"
    lfu = "lfu"
    score = "score"


class ExpertPrediction(str, Enum):
    """Which predictions read a mixture-of-experts model's experts ahead (offload/experts.py)."""

    all = "all"
    entry = "entry"
    next = "next"
    none = "none"


_SAMPLING = "Sampling"
# The metavar of a boolean flag: none. Typer's default, `<bool>`, reads as if it took a value.
FLAG = ""

ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="A model name (see `infer list`), a .gguf file or a Hugging Face model "
        "directory. Default: the registry's default model.",
        metavar="MODEL",
        show_default=False,
    ),
]
RequiredModelArg = Annotated[
    str,
    typer.Argument(
        help="A model name, a Hugging Face repo id, a .gguf file or a model directory.",
        metavar="MODEL",
        show_default=False,
    ),
]
Threads = Annotated[
    int | None,
    typer.Option(
        "--threads", "-t", min=1, help="CPU threads. Default: the number of physical cores."
    ),
]
Ctx = Annotated[
    int | None,
    typer.Option(
        "--ctx",
        "-c",
        "--ctx-size",  # llama.cpp's spelling
        min=1,
        help="Context length in tokens. Default: min(model context, 4096).",
    ),
]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Compute dtype.")]
KVCacheOpt = Annotated[
    KVCache | None,
    typer.Option(
        "--kv-cache",
        help="Format of the KV cache: f32, bf16 (half the memory) or int8 (34 bytes per 32 "
        "values, as llama.cpp's q8_0 cache). Default: the compute dtype's.",
        show_default=False,
    ),
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        metavar="SIZE",
        help="Memory budget for the whole process (RSS plus the model's cached pages), "
        "e.g. 2GB, 1.5GiB, 800MB: layers that do not fit stream from disk. infer's own "
        "format only (infer quantize converts). Default: stream only when the model "
        "does not fit in available memory.",
        show_default=False,
    ),
]
ExpertPolicyOpt = Annotated[
    ExpertPolicy | None,
    typer.Option(
        "--expert-policy",
        help="Eviction policy of the expert cache, for a mixture-of-experts model whose "
        "experts do not all fit (--max-memory): least recently used, least frequently "
        "used, or lowest decayed router score. Default: lfu (the best of the three).",
        show_default=False,
    ),
]
ExpertPredictionOpt = Annotated[
    ExpertPrediction | None,
    typer.Option(
        "--expert-prediction",
        help="Which experts a mixture-of-experts model under --max-memory reads before "
        "they are asked for: all (the next two layers' routers applied early, and each "
        "layer's router on entering it), entry (only the latter: the most precise), next "
        "(only the next layer's), none. Default: all (the fastest from disk).",
        show_default=False,
    ),
]
TraceOut = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        metavar="FILE",
        help="Record what a mixture-of-experts model's routers choose (and predict) into "
        "FILE (.npz), for `infer bench --replay FILE`.",
        show_default=False,
    ),
]
Json = Annotated[
    bool,
    typer.Option("--json", metavar=FLAG, help="Print one JSON object instead of text or a table."),
]
JsonList = Annotated[
    bool,
    typer.Option(
        "--json", metavar=FLAG, help="Print a JSON array, one object per model, instead of a table."
    ),
]
Format = Annotated[
    str | None,
    typer.Option(
        "--format",
        metavar="json|FILE",
        help="Answer in JSON, by constrained decoding: 'json' for any JSON object, or a file "
        "holding a JSON schema the answer must validate against.",
        show_default=False,
    ),
]
ServerHost = Annotated[
    str | None,
    typer.Option(
        "--host",
        metavar="HOST:PORT",
        help="The `infer serve` to ask (or INFER_HOST). Default: 127.0.0.1:11435.",
        show_default=False,
    ),
]
GrammarFile = Annotated[
    str | None,
    typer.Option(
        "--grammar-file",
        metavar="FILE",
        help="The answer follows the llama.cpp grammar (GBNF) in FILE, by constrained decoding.",
        show_default=False,
    ),
]
Verbose = Annotated[
    bool, typer.Option("--verbose", "-v", metavar=FLAG, help="Print timing statistics on stderr.")
]
# main() reads --debug (and INFER_DEBUG=1) itself, so that errors raised before or
# outside a command still get their traceback; the option is declared so it parses.
Debug = Annotated[
    bool,
    typer.Option(
        "--debug", metavar=FLAG, help="Show the full traceback on errors (or INFER_DEBUG=1)."
    ),
]

# --- sampling --------------------------------------------------------------------------

MaxTokens = Annotated[
    int,
    typer.Option(
        "--max-tokens", "-n", min=-1, help="Most tokens to generate; -1: until the context is full."
    ),
]
Temperature = Annotated[
    float,
    typer.Option(
        "--temperature",
        "--temp",  # llama.cpp's spelling
        min=0.0,
        help="Sampling temperature; 0 is greedy and deterministic.",
        rich_help_panel=_SAMPLING,
    ),
]
TopK = Annotated[
    int,
    typer.Option(
        "--top-k", min=0, help="Keep the k likeliest tokens; 0: all.", rich_help_panel=_SAMPLING
    ),
]
TopP = Annotated[
    float,
    typer.Option(
        "--top-p",
        min=0.0,
        max=1.0,
        help="Nucleus sampling: keep the smallest set with this mass.",
        rich_help_panel=_SAMPLING,
    ),
]
MinP = Annotated[
    float,
    typer.Option(
        "--min-p",
        min=0.0,
        max=1.0,
        help="Drop tokens less likely than min-p times the likeliest.",
        rich_help_panel=_SAMPLING,
    ),
]
RepeatPenalty = Annotated[
    float,
    typer.Option(
        "--repeat-penalty",
        min=0.0,
        help="Penalise the last 64 tokens; 1.0: off.",
        rich_help_panel=_SAMPLING,
    ),
]
Seed = Annotated[
    int | None,
    typer.Option(
        "--seed",
        "-s",  # as llama.cpp
        help="Random seed, for reproducible sampling (not with --lookup or --draft: how "
        "many tokens they guess follows measured times).",
        rich_help_panel=_SAMPLING,
    ),
]

# --- speculative decoding --------------------------------------------------------------

SPECULATIVE = "Speculative decoding"  # a help panel
Lookup = Annotated[
    bool,
    typer.Option(
        "--lookup",
        metavar=FLAG,
        help="Guess the next tokens by prompt lookup (what followed the last few tokens "
        "where they occurred before, in the prompt or the answer) and check them in one "
        "pass: faster where the answer copies the prompt (edit this file). The same "
        "answers (greedy: the same text; sampling: the same distribution).",
        rich_help_panel=SPECULATIVE,
    ),
]
Draft = Annotated[
    str | None,
    typer.Option(
        "--draft",
        metavar="DRAFT",
        help="Guess the next tokens with DRAFT, a smaller model of the same tokenizer, and "
        "check them in one pass; the answers as --lookup's. Either way guessing stops "
        "while it does not pay.",
        show_default=False,
        rich_help_panel=SPECULATIVE,
    ),
]

# --- pipeline stages on other machines ----------------------------------------------------

Workers = Annotated[
    str | None,
    typer.Option(
        "--workers",
        metavar="HOST:PORT,...",
        help="Run the model's blocks on these `infer worker`s, in order, each given layers "
        "in proportion to the memory it offers; this process keeps the embeddings, the "
        "output layer and the sampler. Needs --token-file. The links must be on a "
        "trusted network: the hidden states travel unencrypted and unauthenticated.",
        show_default=False,
    ),
]
TokenFile = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        metavar="FILE",
        help="The secret shared with the workers (the same file on each machine, "
        "readable by its owner only, e.g. `head -c 32 /dev/urandom | base64 > F; chmod 600 F`).",
        show_default=False,
    ),
]
