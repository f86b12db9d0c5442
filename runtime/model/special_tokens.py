"""Special tokens a tokenizer finds by name, as llama.cpp does: those that end a turn or
the text, fill-in-the-middle's, and the tags an answer's reader needs (tool calls,
thoughts), which decoding never drops."""

from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer

from .thinking import THINK_TAGS
from .tool_calls import TOOL_CALL_TAGS

# Tokens that end a turn or the text, found by name as llama.cpp does (its special_eog_ids),
# with the FIM tokens that end a filled-in middle (as llama.cpp's); the other FIM tokens
# are left out, being ordinary text in chat and completion.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
    # a fill-in-the-middle answer's other ends (llama.cpp's end-of-generation tokens too)
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|repo_name|>",
)

# Fill-in-the-middle: the tokens before the prefix, the suffix and the middle to write,
# as code models spell them (Qwen2.5-Coder; StarCoder; DeepSeek-Coder).
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)


# Repository-level context before a FIM prompt: the repository's name, then each file
# after a separator (Qwen2.5-Coder; StarCoder2).
FIM_REPO_TOKENS = (("<|repo_name|>", "<|file_sep|>"), ("<reponame>", "<file_sep>"))


def first_ids(backend: _HFTokenizer, spellings) -> tuple[int, ...] | None:
    """The ids of the first of `spellings` the vocabulary has all of, else None."""
    for names in spellings:
        ids = tuple(backend.token_to_id(t) for t in names)
        if None not in ids:
            return ids
    return None


def end_ids(backend: _HFTokenizer) -> set[int | None]:
    """The ids of END_OF_TURN_TOKENS the vocabulary has (None for the others)."""
    return {backend.token_to_id(t) for t in END_OF_TURN_TOKENS}


def kept_ids(backend: _HFTokenizer) -> set[int | None]:
    """The ids of the tags an answer's reader needs (tool_calls.py, thinking.py): kept by
    decode(skip_special=True) even where the file marks them special."""
    return {backend.token_to_id(t) for t in (*TOOL_CALL_TAGS, *THINK_TAGS)}
