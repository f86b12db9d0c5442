"""The interactive chat loop and its commands; answers stream through
`runtime.answer.stream_answer`, printed as they come."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import InferError
from ..runtime.answer import stream_answer
from ..runtime.generate import Penalties, Sampler, make_sampler
from ..runtime.loader import LoadedModel
from ..runtime.session import Session
from .common import human_count, print_table


def stream_line(lm: LoadedModel) -> str | None:
    """What streaming layers (or experts) from disk cost so far (--verbose), or None if
    nothing streams."""
    if lm.experts is not None:
        return "experts: " + lm.experts.describe()
    if lm.stream is None:
        return None
    from ..offload.stream import describe

    return "stream: " + describe(lm.stream, lm.plan)


# ------------------------------------------------------------------------------------------
# Interactive chat
# ------------------------------------------------------------------------------------------

HELP = """\
  /set system TEXT            a new system message; the conversation restarts from it
  /set parameter NAME VALUE   a sampling setting (/show parameters lists them)
  /show info                  the model: architecture, parameters, context, quantization
  /show parameters            the sampling settings
  /show system                the system message
  /clear, /reset              forget the conversation (the system message stays)
  /exit, /bye                 quit (Ctrl-D also quits)
  /help, /?                   this text
  \"\"\"                         start or end a message of several lines
  A line starting with // or a space is a message, even if it names a command.
  Ctrl-C stops an answer; the conversation keeps what was said so far.
"""


# /set parameter NAME VALUE: ollama's name -> (ChatSettings field, parse, valid, range),
# the ranges those of `infer run`'s options.
PARAMETERS = {
    "temperature": ("temperature", float, lambda v: 0 <= v < math.inf, ">= 0"),
    "top_k": ("top_k", int, lambda v: v >= 0, ">= 0 (0: all)"),
    "top_p": ("top_p", float, lambda v: 0 <= v <= 1, "from 0 to 1"),
    "min_p": ("min_p", float, lambda v: 0 <= v <= 1, "from 0 to 1"),
    "seed": ("seed", int, lambda v: True, "an integer"),
    "num_predict": ("max_tokens", int, lambda v: v >= -1, ">= -1 (-1: until the context is full)"),
    "repeat_penalty": ("repeat_penalty", float, lambda v: 0 <= v < math.inf, ">= 0 (1: off)"),
}


@dataclass
class ChatSettings:
    """What the chat's commands may change; `sampler` follows the sampling fields."""

    max_tokens: int = 512
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    repeat_penalty: float = 1.0
    system: str | None = None
    verbose: bool = False
    sampler: Sampler = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sampler = make_sampler(self.temperature, self.top_k, self.top_p, self.min_p, self.seed)

    def set_parameter(self, name: str, value: str) -> None:
        """Set ollama's parameter `name`; ValueError (one line) if name or value is bad."""
        if name not in PARAMETERS:
            raise ValueError(f"unknown parameter {name}; /show parameters lists them")
        attr, parse, valid, allowed = PARAMETERS[name]
        try:
            v = parse(value)
        except ValueError:
            v = None
        if v is None or not valid(v):
            raise ValueError(f"{name} must be {allowed}, not {value}")
        setattr(self, attr, v)
        self.__post_init__()  # a new sampler for the new value

    def parameters(self) -> list[list[str]]:
        seed = "random" if self.seed is None else str(self.seed)
        values = {**{n: str(getattr(self, a)) for n, (a, *_) in PARAMETERS.items()}, "seed": seed}
        return [[n, values[n]] for n in PARAMETERS]


def _read_message() -> str | None:
    """One user message from the terminal; None at end of input (Ctrl-D)."""
    try:
        line = input(">>> ")
    except EOFError:
        return None
    if not line.strip().startswith('"""'):
        return line
    # Multi-line: everything up to a line ending in """.
    lines = [line.strip()[3:]]
    while not lines[-1].rstrip().endswith('"""'):
        try:
            lines.append(input("... "))
        except EOFError:
            return None
    lines[-1] = lines[-1].rstrip()[:-3]
    return "\n".join(lines).strip("\n")


def fit_context(tok, messages: list[dict], budget: int) -> list[int]:
    """Encode `messages`, dropping the oldest exchanges (never the system message)
    until the prompt is at most `budget` tokens; the newest message always stays."""
    ids = tok.encode_chat(messages)
    first = 1 if messages and messages[0]["role"] == "system" else 0
    while len(ids) > budget and len(messages) - first > 1:
        del messages[first]
        ids = tok.encode_chat(messages)
    return ids


@dataclass
class Chat:
    """What the commands act on: the model, the settings, the conversation so far."""

    lm: LoadedModel
    settings: ChatSettings
    messages: list[dict] = field(default_factory=list)

    def restart(self) -> None:
        """Forget the conversation; keep the system message."""
        system = self.settings.system
        self.messages = [{"role": "system", "content": system}] if system else []


class CommandError(Exception):
    """A command's usage or value is wrong: one line on stderr, nothing sent."""


def _set(chat: Chat, arg: str) -> None:
    what, _, rest = arg.partition(" ")
    if what == "system" and rest.strip():
        chat.settings.system = rest.strip()
        chat.restart()
        print("(system message set; conversation cleared)", file=sys.stderr)
    elif what == "parameter" and len(rest.split()) == 2:
        name, value = rest.split()
        try:
            chat.settings.set_parameter(name, value)
        except ValueError as err:
            raise CommandError(str(err)) from None
        print(f"(set {name} to {value})", file=sys.stderr)
    else:
        raise CommandError("usage: /set system TEXT, or /set parameter NAME VALUE")


def _show(chat: Chat, arg: str) -> None:
    if arg == "info":
        lm, ctx = chat.lm, chat.lm.model.max_seq_len
        a, source = lm.source.args, lm.source
        archs = ", ".join(source.config.get("architectures") or ["?"])
        trained = f" (trained on {a.max_seq_len})" if a.max_seq_len != ctx else ""
        rows = [  # as `infer info` prints them
            ["architecture", f"{a.model_type} ({archs})"],
            ["parameters", f"{human_count(a.n_params)} ({a.n_params:,})"],
            ["context length", f"{ctx}{trained}"],
            ["quantization", source.quantization],
        ]
        print_table(None, rows)
    elif arg == "parameters":
        print_table(None, chat.settings.parameters())
    elif arg == "system":
        print(chat.settings.system or "(no system message)")
    else:
        raise CommandError("usage: /show info, /show parameters or /show system")


def _clear(chat: Chat, arg: str) -> None:
    chat.restart()
    print("(conversation cleared)", file=sys.stderr)


def _help(chat: Chat, arg: str) -> None:
    print(HELP)


def _exit(chat: Chat, arg: str) -> bool:
    return True


# Each command: a function of the chat and the rest of the line; True ends the chat.
COMMANDS: dict[str, Callable[[Chat, str], bool | None]] = {
    "/set": _set,
    "/show": _show,
    "/clear": _clear,
    "/reset": _clear,
    "/help": _help,
    "/?": _help,
    "/exit": _exit,
    "/bye": _exit,
}


def run_command(chat: Chat, line: str) -> bool | None:
    """If `line` is a command, run it and return whether the chat ends; None if `line`
    is a message. A line starting with // or a space is a message."""
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, arg = line.strip().partition(" ")
    command = COMMANDS.get(name)
    try:
        if command is None:
            raise CommandError(f"unknown command {name}; /help lists them")
        return bool(command(chat, arg.strip()))
    except CommandError as err:
        print(err, file=sys.stderr)
        return False


def chat_loop(lm: LoadedModel, settings: ChatSettings) -> None:
    """Read messages at a `>>> ` prompt and stream answers until /exit or Ctrl-D."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on Windows; input() still works without it
        pass

    session, tok = Session(lm.model), lm.tokenizer
    chat = Chat(lm, settings)
    chat.restart()
    out = sys.stdout

    while True:
        try:
            text = _read_message()
        except KeyboardInterrupt:
            print("\n(use /exit, /bye or Ctrl-D to quit)", file=sys.stderr)
            continue
        if text is None:
            print(file=out)
            return
        if not text.strip():
            continue
        done = run_command(chat, text)
        if done:
            return
        if done is not None:
            continue

        messages = chat.messages
        messages.append({"role": "user", "content": text})
        # Room kept for the answer when old turns have to go.
        limit = settings.max_tokens if settings.max_tokens > 0 else session.max_seq_len
        reserve = min(limit, session.max_seq_len // 4)
        before = len(messages)
        ids = fit_context(tok, messages, session.max_seq_len - reserve)
        if len(messages) < before:
            print("(oldest messages dropped to fit the context)", file=sys.stderr)

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

        try:
            answer = stream_answer(
                session, tok, ids, settings.sampler, settings.max_tokens, show,
                Penalties(repeat=settings.repeat_penalty),
            )  # fmt: skip
        except InferError as err:  # e.g. one message longer than the context
            messages.pop()
            print(f"error: {err}", file=sys.stderr)
            continue
        if answer.finish_reason == "interrupted" and not answer.tokens:
            messages.pop()  # nothing was answered: forget the question too
        else:
            messages.append({"role": "assistant", "content": answer.text})
        print("" if answer.text.endswith("\n") else "\n", end="", file=out, flush=True)
        if answer.finish_reason == "interrupted":
            print("(stopped)", file=sys.stderr)
        if note := answer.context_note():
            print(note, file=sys.stderr)
        if settings.verbose:
            print(answer.stats_line(), file=sys.stderr)
            if line := stream_line(lm):
                print(line, file=sys.stderr)
        print(file=out, flush=True)  # a blank line before the next prompt
