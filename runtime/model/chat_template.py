"""Chat templates: untrusted Jinja code from the model file, rendered in a sandbox with
the variables and helpers transformers provides."""

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ... import InferError


class ChatTemplate:
    """A compiled template: `render(messages, add_generation_prompt, bos_token=...)`."""

    def __init__(self, source: str):
        self._template = _compile_template(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **tokens) -> str:
        context = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
            **tokens,
        }
        try:
            return self._template.render(**context)
        except InferError:
            raise  # raise_exception() from the template: already one clear line
        except Exception as err:
            # The template is code from the model file and can fail any way it likes;
            # whatever it was, the user gets one line naming it.
            raise InferError(
                f"chat template failed: {type(err).__name__}: {_one_line(err)}"
            ) from err


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox transformers uses, but touching an unsafe attribute (`__class__`) fails
    at once instead of rendering as empty, so a template probing for a way out stops."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )


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
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    # A plain dict() constructor, without the `dict` type itself to reach through.
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise InferError(f"chat template does not parse: {_one_line(err)}") from err
