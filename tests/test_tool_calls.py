"""Tool calls (runtime/model/tool_calls.py): the calls read from an answer, whole or as it
streams; templates offered tools render as transformers renders them; an answer that
must be a call is one (the grammar), even from a random model."""

import json
import random

import jsonschema
import pytest
from tiny import HERMES, MISTRAL, MISTRAL_TOKENS, make_hf_model, set_chat_template

from infer.runtime.answer import stream_answer
from infer.runtime.generate import make_sampler
from infer.runtime.loader import load_model
from infer.runtime.model.tool_calls import (
    CallFormat,
    CallSplitter,
    ToolCall,
    _find_calls,
    call_format,
    call_schema,
    parse_calls,
)
from infer.runtime.session import Session
from infer.runtime.structured import compile_tool_call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
NONE = {"type": "object", "properties": {}, "additionalProperties": False}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": NONE}}
NAMES = {"get_weather", "get_time"}

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
PARIS = ToolCall("get_weather", {"city": "Paris", "unit": "c"})

ANSWERS = [  # (answer, text without the calls, calls)
    (f"<tool_call>\n{CALL}\n</tool_call>", "", [PARIS]),
    (f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", "Let me look.", [PARIS]),
    (
        f'<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": "{{}}"}}',
        "",
        [PARIS, ToolCall("get_time", {})],
    ),  # the last tag unclosed, arguments as a JSON string
    (f"```json\n{CALL}\n```", "", [PARIS]),  # small models drop the tags
    (f"  {CALL}", "", [PARIS]),
    (f"<tool_call>\n{CALL}\n</tool_call>\nDone.", "Done.", [PARIS]),
    ("Use <tool_call> tags to call a tool.", "Use <tool_call> tags to call a tool.", []),
    ('{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}', []),  # no such tool
    ("{{" + CALL[1:-1] + "}}", "{{" + CALL[1:-1] + "}}", []),  # not JSON
    (f"I would call it so: {CALL}", f"I would call it so: {CALL}", []),  # not at the start
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    (  # a regex with a backslash JSON has no escape for: a literal backslash
        '{"name": "get_time", "arguments": {"pattern": ".*\\.py$", "d": "\\\\d"}} ok',
        "ok",
        [ToolCall("get_time", {"pattern": ".*\\.py$", "d": "\\d"})],
    ),
    (f"[TOOL_CALLS] [{CALL}]", "", [PARIS]),  # Mistral's list
    (
        f'[TOOL_CALLS][{CALL}, {{"name": "get_time", "arguments": {{}}}}]',
        "",
        [PARIS, ToolCall("get_time", {})],
    ),
    (f"Checking.[TOOL_CALLS] [{CALL}]", "Checking.", [PARIS]),
    (f"[{CALL}]", "", [PARIS]),  # the list alone
    ("[1, 2] is a list.", "[1, 2] is a list.", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,rest,calls", ANSWERS)
def test_parse_calls(text, rest, calls):
    assert parse_calls(text, NAMES) == (rest, calls)


@pytest.mark.parametrize("text,rest,calls", ANSWERS)
def test_streamed_calls_equal_the_whole(text, rest, calls):
    """Split anywhere, the text shown and then `finish`'s equal the whole's parse, and no
    part of a call is ever shown."""
    for size in (1, 2, 3, 7, len(text) or 1):
        splitter = CallSplitter(NAMES)
        shown = "".join(splitter.feed(text[i : i + size]) for i in range(0, len(text), size))
        left, got = splitter.finish()
        assert got == calls
        if calls:
            assert (
                "name" not in shown and "\n\n".join(t for t in (shown.rstrip(), left) if t) == rest
            )
        else:
            assert shown + left == text


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool", "_call>", "[TOOL_CALLS]", "[TOOL", "[", "]", ", ", "```json", "```", "\n", "  ", "{", "}",
    '"name"', ": ", CALL, '{"name": "get_time", "arguments": {}}', '{"name": "x"}', "Sure.",
    "It is ", "[1, 2]", '"arguments"', "é", "🙂", "\\", '"\\.py"',
    '{"name": "get_time", "arguments": {"p": "a\\.b"}}',
]  # fmt: skip


@pytest.mark.parametrize("seed", range(200))
def test_random_answers_stream_as_they_parse(seed):
    """Answers made of calls, tags, braces and prose, split at random: the splitter never
    fails, finds the calls parse_calls finds, and shows all of an answer without calls."""
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
    rest, calls = parse_calls(text, NAMES)
    splitter, shown, at = CallSplitter(NAMES), [], 0
    while at < len(text):
        n = rng.randint(1, 8)
        shown.append(splitter.feed(text[at : at + n]))
        at += n
    left, got = splitter.finish()
    assert got == calls, text
    shown = "".join(shown)
    if calls:  # what was shown comes before the first call
        assert text.startswith(shown) and len(shown) <= _find_calls(text, NAMES)[0]
    else:
        assert shown + left == text == rest


def test_plain_answers_stream_at_once():
    splitter = CallSplitter(NAMES)
    assert splitter.feed("The weather ") == "The weather "
    assert splitter.feed("is fine <tool") == "is fine "  # may begin a tag: held
    assert splitter.feed("s>") == "<tools>"
    assert splitter.feed(" and [TOOL") == " and "  # Mistral's tag, maybe
    assert splitter.feed("S] too") == "[TOOLS] too"


# Llama 3's way, imitated in ChatML's tokens: tools listed with an instruction naming
# "parameters", a call answered as the object alone.
LLAMA3 = (
    "{%- if tools %}<|im_start|>system\nCall a tool as "
    '{"name": function name, "parameters": its arguments}:'
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_call_format():
    assert call_format(HERMES) == CallFormat(tagged=True, key="arguments")
    assert call_format(LLAMA3) == CallFormat(tagged=False, key="parameters")
    assert call_format("{{ tools }}") == CallFormat(tagged=False, key="arguments")
    assert call_format(MISTRAL) == CallFormat(tagged=False, key="arguments")
    assert call_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_call_schema_names_the_tools():
    one = call_schema([WEATHER, TIME], "get_time")
    assert one["properties"]["name"] == {"const": "get_time"}
    both = call_schema([WEATHER, TIME])
    jsonschema.validate(json.loads(CALL), both)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "arguments": {}, "x": 1}, both)


# -- templates and the grammar, on a tiny random model -----------------------------------


@pytest.fixture(scope="module", params=["hermes", "llama3", "mistral"])
def tiny(request, tmp_path_factory):
    """A random Qwen2-shaped model, one token per byte, its template HERMES, LLAMA3 or
    MISTRAL (with Mistral's control tokens)."""
    path = tmp_path_factory.mktemp("tools") / "tiny"
    specials = MISTRAL_TOKENS if request.param == "mistral" else ()
    make_hf_model("qwen2", path, specials=specials, max_position_embeddings=1024)
    set_chat_template(path, {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL}[request.param])
    return path


CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": json.loads(CALL), "id": "a1b2c3d4e"}],
    },
    {"role": "tool", "content": '{"temp": 18}', "tool_call_id": "a1b2c3d4e"},
]


def test_template_with_tools_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tiny)
    tok = load_model(tiny).tokenizer
    assert tok.tool_format is not None
    for tools in ([WEATHER], [WEATHER, TIME], None):
        ours = tok.apply_chat_template(CHAT, tools=tools)
        expect = theirs.apply_chat_template(
            CHAT, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours == expect
        assert ('"get_weather", "description"' in ours) == (tools is not None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_call_from_a_random_model(tiny, seed):
    """Under the call's grammar a random model's answer is a call that validates."""
    lm = load_model(tiny)
    tok = lm.tokenizer
    ids = tok.encode_chat(CHAT[:1], tools=[WEATHER, TIME])
    fmt = tok.tool_format
    schema = call_schema([WEATHER, TIME], key=fmt.key)
    constraint = compile_tool_call(tok, schema, fmt.tagged).matcher()
    answer = stream_answer(
        Session(lm.model),
        tok,
        ids,
        make_sampler(1.0, seed=seed),
        300,
        lambda _: None,
        constraint=constraint,
    )
    assert answer.finish_reason == "stop", answer.text
    rest, calls = parse_calls(answer.text, NAMES)
    assert rest == "" and len(calls) == 1, answer.text
    call = calls[0]
    schema = {WEATHER["function"]["name"]: WEATHER, TIME["function"]["name"]: TIME}[call.name]
    jsonschema.validate(call.arguments, schema["function"]["parameters"])
    # laid out as json.dumps writes it, as the template writes earlier calls
    start, end = ("<tool_call>\n", "\n</tool_call>") if fmt.tagged else ("", "")
    assert answer.text.startswith(start + '{"name": "') and answer.text.endswith("}" + end)
    assert f'"{fmt.key}": ' in answer.text
