"""Pre-tokenizers: the regex splits llama.cpp's llama-vocab.cpp applies before BPE, chosen
by a GGUF's `tokenizer.ggml.pre`."""

from tokenizers import Regex, pre_tokenizers

# llama.cpp rewrites (?i:...) as explicit [sS] classes for its own regex engine; the
# `tokenizers` library (Oniguruma) takes the originals from the models' tokenizer.json.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    (
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
]
_FALCON = [
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
]


def _names(names: str, splits: list[str], ignore_merges: bool = False) -> dict:
    return {name: (splits, ignore_merges) for name in names.split()}


# tokenizer.ggml.pre -> (regexes applied in turn, each piece split by the next; whether
# a piece that is itself a token skips BPE, llama.cpp's `ignore_merges`).
PRE_TOKENIZERS = {
    **_names("default gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4", [_GPT2]),
    **_names("jina-es jina-de jina-v1-en jina-v2-es jina-v2-de jina-v2-code", [_GPT2]),
    **_names("roberta-bpe gigachat a.x-4.0 mellum modern-bert", [_GPT2]),
    # "smollm" and the StarCoder family: every digit alone, then GPT-2's split. The
    # transformers GGUF converter leaves out the digit split; SmolLM2's own
    # tokenizer.json has it (Digits(individual_digits=True) before ByteLevel).
    **_names(
        "smollm starcoder refact command-r codeshell exaone minerva-7b mellum2",
        [r"\p{N}", _GPT2],
    ),
    **_names(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        [_LLAMA3],
        ignore_merges=True,
    ),
    **_names("dbrx smaug-bpe chatglm-bpe glm4", [_LLAMA3]),
    **_names(
        "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open",
        [_QWEN2],
    ),
    **_names("qwen35", [_QWEN35]),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", [_GPT4O]),
    **_names("tekken", [_TEKKEN], ignore_merges=True),
    **_names("deepseek-coder", _DEEPSEEK_CODER),
    **_names("deepseek-v3", _DEEPSEEK_V3),
    **_names("falcon", _FALCON),
}
# Any other name (deepseek-llm, bloom, viking, ...) falls back to GPT-2's split: close
# for English, but not what those models were trained with. llama.cpp itself would
# refuse an unknown name; the transformers converter also falls back to GPT-2.
FALLBACK_PRE_TOKENIZER = "default"


def byte_level_pre_tokenizer(splits: list[str]):
    # behavior="isolated": matches and the text between them both become pieces, as in
    # llama.cpp's unicode_regex_split. ByteLevel then only maps bytes to its alphabet.
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
