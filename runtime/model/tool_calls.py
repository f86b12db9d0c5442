"""Tool calls as chat templates ask for them. Two formats, told apart by the template:

- Hermes (Qwen2.5, Qwen3, Hermes, SmolLM3): each call in tags, after any text,

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- Llama 3.1-3.3 (a template that lists tools without the tags): the answer is the object
  alone, {"name": "get_weather", "parameters": {"city": "Paris"}}.

- Mistral (7B v0.3, Nemo, Small): a list after a control token,

      [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

Small models often drop the tags, or put the object in a ```json fence: an answer that
begins with an object is read as calls in either format (as llama.cpp's server reads
them). An object is a call only if it names an offered tool.

Here: a template's format, the calls in an answer (whole, or as it streams), and the
schema of a call, for an answer that must be one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
# Single tokens in Qwen's and Mistral's vocabularies, marked special (or control)
TOOL_CALL_TAGS = (OPEN, CLOSE, MISTRAL)

# Where a call's object starts: after its tag or fence, if any, or in a list; and what
# may close it.
_OPENER = re.compile(r"\s*(?:<tool_call>|\[TOOL_CALLS\]|```(?:json)?)?\s*[\[,]?\s*(?=\{)")
_CLOSER = re.compile(r"\s*(?:</tool_call>|```|\])?")
# The beginnings of an answer that is calls, whitespace taken out.
_STARTS = (OPEN, MISTRAL, '```json{"name"', '```{"name"', '{"name"', '[{"name"')


@dataclass(frozen=True)
class CallFormat:
    tagged: bool  # each call in <tool_call> tags (Hermes), else the object alone
    key: str  # the arguments' key: "arguments", or Llama 3's "parameters"


def call_format(template: str) -> CallFormat | None:
    """How a chat template asks for calls; None if it lists no tools."""
    if re.search(r"\btools\b", template) is None:
        return None
    if OPEN in template:
        return CallFormat(tagged=True, key="arguments")
    return CallFormat(tagged=False, key="parameters" if '"parameters"' in template else "arguments")


@dataclass
class ToolCall:
    name: str
    arguments: dict


def parse_calls(text: str, names: set[str]) -> tuple[str, list[ToolCall]]:
    """(the answer's text without its calls, the calls) where the answer begins with
    calls or has a <tool_call> tag; (text, []) when it has none, or when what follows is
    not a call of one of `names` (the model wrote about a call): then it is all text."""
    found = _find_calls(text, names)
    if found is None:
        return text, []
    at, calls, end = found
    before, after = text[:at].rstrip(), text[end:].strip()
    return "\n\n".join(t for t in (before, after) if t), calls


def _find_calls(text: str, names: set[str]) -> tuple[int, list[ToolCall], int] | None:
    """Where the calls start, the calls, where they end; None if there are none."""
    for at in (0, _tag(text)):
        if at < 0 or at == 0 and not _starts_calls(text):
            continue
        calls, end = _scan(text, at, names)
        if calls:
            return at, calls, end
    return None


def _starts_calls(text: str) -> bool:
    return _squeezed(text).startswith(_STARTS)


def _squeezed(text: str) -> str:
    """The answer's start, whitespace taken out (as _STARTS are written)."""
    return re.sub(r"\s+", "", text[:64])


def _scan(text: str, pos: int, names: set[str]) -> tuple[list[ToolCall], int]:
    """The calls from `pos` on, one after another, and where they end."""
    calls = []
    while m := _OPENER.match(text, pos):
        try:
            obj, end = _json_object(text, m.end())
        except ValueError:
            break
        call = _call(obj, names)
        if call is None:
            break
        calls.append(call)
        pos = _CLOSER.match(text, end).end()
    return calls, pos


# A backslash that begins no JSON escape: models write regexes and Windows paths so
# (".*\.py$"); taken as a literal backslash.
_STRAY_BACKSLASH = re.compile(r'\\(["\\/bfnrtu])|\\')


def _json_object(text: str, at: int) -> tuple[object, int]:
    """The JSON value at `at` and where it ends, its stray backslashes forgiven."""
    decoder = json.JSONDecoder()
    try:
        return decoder.raw_decode(text, at)
    except ValueError:
        added = []  # where, in the repaired text, a backslash was added

        def escape(m: re.Match) -> str:
            if m[1]:
                return m[0]
            added.append(m.start() + len(added))
            return "\\\\"

        fixed = _STRAY_BACKSLASH.sub(escape, text[at:])
        if not added:
            raise
        obj, n = decoder.raw_decode(fixed)
        return obj, at + n - sum(1 for p in added if p < n)


def _call(obj, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


class CallSplitter:
    """An answer's text as it streams: `feed` returns what may be shown now. The start
    of the answer is held while it may be a call; later, the end of a piece that may
    begin a <tool_call> tag, and everything from the tag on. `finish` returns the rest to
    show and the calls (parse_calls of the whole answer)."""

    def __init__(self, names: set[str]):
        self._names = names
        self._text = ""  # the whole answer so far
        self._shown = 0  # how much of it `feed` returned
        self._at_start = True  # nothing shown yet: the answer may be calls

    def feed(self, piece: str) -> str:
        self._text += piece
        text = self._text
        if self._at_start:
            squeezed = _squeezed(text)
            if any(s.startswith(squeezed) or squeezed.startswith(s) for s in _STARTS):
                return ""  # a call, or maybe one: held
            self._at_start = False
        tag = _tag(text, self._shown)
        end = tag if tag >= 0 else len(text) - _partial_tag(text)
        out, self._shown = text[self._shown : max(end, self._shown)], max(end, self._shown)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        found = _find_calls(self._text, self._names)
        if found is None:
            return self._text[self._shown :], []
        at, calls, end = found  # the text before `at` not shown yet, and after the calls
        parts = (self._text[self._shown : at].rstrip(), self._text[end:].strip())
        return "\n\n".join(t for t in parts if t), calls


def _tag(text: str, start: int = 0) -> int:
    """Where the first tag that opens calls is in `text` from `start`, or -1."""
    found = [i for i in (text.find(OPEN, start), text.find(MISTRAL, start)) if i >= 0]
    return min(found, default=-1)


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` begin a tag that opens calls."""
    for n in range(min(len(MISTRAL) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]) or MISTRAL.startswith(text[-n:]):
            return n
    return 0


def call_schema(tools: list[dict], name: str | None = None, key: str = "arguments") -> dict:
    """The JSON schema of one call's object ({"name", key}) of one of `tools` (OpenAI's
    {"type": "function", "function": {...}}), or of the one called `name`."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                key: t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
        if name is None or t["function"]["name"] == name
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_names(tools: list[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}
