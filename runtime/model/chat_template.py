"""Chat templates: untrusted Jinja code from the model file, rendered in a sandbox with
the variables and helpers transformers provides, within a time and a size limit; and the
templates a model without one chats in (ChatML, Gemma's turns).

The limits: every loop iteration checks the render's deadline (loops are the only way a
template runs long; recursion ends at Python's depth), and every string or list a
template builds by `~`, `+`, `*` or `**`, every number it passes to a call or filter, and
the output, stay under MAX_CHARS, checked before they are made.
"""

import contextvars
import json
import re
import time
from datetime import datetime
from functools import wraps

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ... import InferError

RENDER_SECONDS = 5.0  # templates render in milliseconds; a loop of 10^10 never ends
MAX_CHARS = 1 << 26  # 64 Mi characters: more text than any context holds

# The deadline of the render running in this thread (or task): renders may run side by
# side, one per conversation.
_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline")


# No template in the model: llama.cpp falls back to ChatML, and so do we, unless the
# vocabulary has Gemma's turn tokens: then Gemma's own turns (a system prompt goes before
# the first user turn's text, as Gemma's template puts it; "assistant" is "model").
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (system if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


class ChatTemplate:
    """A compiled template: `render(messages, add_generation_prompt, tools, variables,
    bos_token=...)`."""

    def __init__(self, source: str):
        self._template = _compile_template(source)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        variables: dict | None = None,
        **tokens,
    ) -> str:
        """`variables`: more for the template to read, as a caller asks (Qwen3's
        enable_thinking); they may not replace the ones transformers provides."""
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": tools or None,
            "documents": None,
            **tokens,
        }
        taken = sorted(set(variables or ()) & set(context))
        if taken:
            raise InferError(f"chat template variables may not set {', '.join(taken)}")
        context.update(variables or {})
        token = _deadline.set(time.monotonic() + RENDER_SECONDS)
        try:
            out, size = [], 0
            for chunk in self._template.generate(**context):
                size += len(chunk)
                _check_size(size, "output")
                out.append(chunk)
            return "".join(out)
        except InferError:
            raise  # raise_exception() from the template, or a limit: already one clear line
        except Exception as err:
            # The template is code from the model file and can fail any way it likes;
            # whatever it was, the user gets one line naming it.
            raise InferError(
                f"chat template failed: {type(err).__name__}: {_one_line(err)}"
            ) from err
        finally:
            _deadline.reset(token)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers uses, but touching an unsafe attribute (`__class__`) fails
    at once instead of rendering as empty, so a template probing for a way out stops; and
    with the limits of the module docstring."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )

    def _parse(self, source, name, filename):
        return _Limited().visit(super()._parse(source, name, filename))

    def call_binop(self, context, op, left, right):
        _check_binop(op, left, right)
        return super().call_binop(context, op, left, right)

    def call(self, context, obj, /, *args, **kwargs):
        _check_args(args, kwargs)
        return super().call(context, obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # "{:>99999999}".format: the widths of the string's fields
            for field in _FORMAT_FIELD.findall(value.__self__):
                _check_widths(field.partition(":")[2])
        return wrapped


class _Limited(NodeTransformer):
    """The parsed template with every loop's iterable taken through `_timed` and every
    `~` through `_sized` (filters the environment defines)."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _filter(node.iter, "_timed")
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _filter(node, "_sized")


def _filter(node, name: str) -> jinja2.nodes.Filter:
    return jinja2.nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


def _timed(iterable):
    deadline = _deadline.get()
    for item in iterable:
        if time.monotonic() > deadline:
            raise InferError(f"chat template takes more than {RENDER_SECONDS:g} s to render")
        yield item


def _sized(text):
    _check_size(len(text), "string")
    return text


def _check_size(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise InferError(f"chat template makes a {what} of more than {MAX_CHARS} characters")


def _length(x) -> int:
    return len(x) if isinstance(x, (str, list, tuple)) else 0


def _check_binop(op: str, left, right) -> None:
    """Refuse what would make a string, list or number past the limit, before it is made."""
    if op == "+":
        _check_size(_length(left) + _length(right), "string or list")
    elif op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and _length(seq):
                _check_size(_length(seq) * n, "string or list")
    elif op == "**" and isinstance(left, int) and isinstance(right, int):
        _check_size(abs(left).bit_length() * right // 3, "number")  # ~ its decimal digits
    elif op == "%" and isinstance(left, str):
        _check_format(left)
        _check_args(right if isinstance(right, tuple) else (right,), {})  # "%*s" % (n, x)


# A %-format's width and precision ("%99999999s"), and a str.format field ("{:>99999999}")
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*(?:\.\d*)?)")
_FORMAT_FIELD = re.compile(r"\{([^{}]*)\}")


def _check_format(fmt: str) -> None:
    for widths in _PERCENT_FIELD.findall(fmt):
        _check_widths(widths)


def _check_widths(spec: str) -> None:
    for digits in re.findall(r"\d+", spec):
        _check_size(int(digits) if len(digits) < 20 else MAX_CHARS + 1, "formatted field")


def _check_args(args, kwargs) -> None:
    """A number passed to a call or filter is at most the limit (`"x".center(10**10)`)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and abs(a) > MAX_CHARS:
            raise InferError(f"chat template passes {a} to a call, more than {MAX_CHARS}")


def _limited_filter(f):
    @wraps(f)  # keeps jinja2's pass_context marks
    def call(*args, **kwargs):
        _check_args(args, kwargs)
        return f(*args, **kwargs)

    return call


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers marks assistant text with it
    for training masks; rendering just keeps the body."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _one_line(message) -> str:
    return " ".join(str(message).split())


def _raise_exception(message):
    raise InferError(f"chat template refused the conversation: {_one_line(message)}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: no HTML escaping (Jinja's own escapes <, > and &).
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _compile_template(source: str):
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _limited_filter(f) for name, f in env.filters.items()}
    env.filters["_timed"], env.filters["_sized"] = _timed, _sized
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    # A plain dict() constructor, without the `dict` type itself to reach through.
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise InferError(f"chat template does not parse: {_one_line(err)}") from err
