"""The interactive chat loop and its commands. Answers come from a `LocalModel` (loaded
in this process, through `runtime.answer.stream_answer`) or a `RemoteModel` (a running
`infer serve`, cli/client.py), printed as they come.

Only the standard library at import: a chat with a server never imports torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .. import InferError
from .common import human_count, print_table

if TYPE_CHECKING:
    from ..runtime.loader import LoadedModel
    from ..runtime.speculative import Drafter


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
  /set think, /set nothink    a thinking model thinks first, or answers at once
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
    format: str | dict | None = None  # run --format: "json" or a JSON schema
    grammar: str | None = None  # run --grammar-file: a GBNF grammar's text
    think: bool | None = None  # run --think / --no-think: a thinking model's switch
    _sampler: object = field(default=None, init=False, repr=False)

    @property
    def sampler(self):
        """The sampler of the current settings, made once (a seeded one keeps its state)."""
        if self._sampler is None:
            from ..runtime.generate import make_sampler

            self._sampler = make_sampler(
                self.temperature, self.top_k, self.top_p, self.min_p, self.seed
            )
        return self._sampler

    def options(self) -> dict:
        """The settings as the server's ollama-style options."""
        options = {
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "min_p": self.min_p, "seed": self.seed, "num_predict": self.max_tokens,
            "repeat_penalty": self.repeat_penalty,
        }  # fmt: skip
        return {k: v for k, v in options.items() if v is not None}

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
        self._sampler = None  # a new sampler for the new value

    def template_vars(self) -> dict | None:
        """What the chat template is given beyond the messages."""
        return None if self.think is None else {"enable_thinking": self.think}

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


class WordWrap:
    """Writes streamed text to a terminal of `width` columns, breaking lines between
    words rather than inside them (as ollama's chat does). A word is held back until it
    ends, or until it alone fills a line."""

    def __init__(self, out, width: int):
        self.out, self.width = out, max(width, 10)
        self.col, self.word = 0, ""

    def write(self, text: str) -> None:
        for c in text:
            if c == "\n":
                self._word()
                self._put("\n")
            elif c in " \t":
                self._word()
                if self.col + 1 > self.width:
                    self._put("\n")  # the space itself ends the line
                else:
                    self._put(c)
            else:
                self.word += c
                if _columns(self.word) >= self.width:
                    self._word()
        self.out.flush()

    def flush(self) -> None:
        self._word()
        self.out.flush()
        self.col = 0

    def _word(self) -> None:
        if self.word:
            n = _columns(self.word)
            if self.col and self.col + n > self.width:
                self._put("\n")
            self._put(self.word)
            self.word = ""

    def _put(self, text: str) -> None:
        self.out.write(text)
        self.col = 0 if text == "\n" else self.col + _columns(text)


class ThoughtDisplay:
    """A thinking model's thoughts on a terminal, dimmed before the answer as ollama's
    chat shows them: "Thinking...", the thoughts, "...done thinking.". `show` writes
    them (None: they are not shown); `end` closes them when the answer begins."""

    DIM, PLAIN = "\x1b[2m", "\x1b[0m"

    def __init__(self, out, show: Callable[[str], None] | None):
        self.out, self.show, self.open = out, show, False

    def __call__(self, piece: str) -> None:
        if self.show is None:
            return
        if not self.open:
            self.out.write(self.DIM)
            self.show("Thinking...\n")
            self.open = True
        self.show(piece)

    def end(self) -> None:
        if self.open:
            self.show("\n...done thinking.\n\n")
            self.out.write(self.PLAIN)
            self.out.flush()
            self.open = False

    def then(self, show: Callable[[str], None]) -> Callable[[str], None]:
        """`show` for the answer's text, closing the thoughts first."""

        def answer(piece: str) -> None:
            self.end()
            show(piece)

        return answer


def _columns(text: str) -> int:
    """Terminal columns: East Asian wide and full-width characters take two."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


class ChatModel(Protocol):
    """What the chat talks to: a model in this process or behind a server."""

    name: str

    def answer(
        self, messages: list[dict], settings: ChatSettings, on_text, on_thought=None
    ) -> tuple[object, int]:
        """Stream the answer to `messages` (an Answer or RemoteAnswer) and the number of
        oldest messages dropped to fit the context; a thinking model's thoughts go to
        `on_thought` and the answer's `thinking`, apart from its text."""

    def complete(self, prompt: str, settings: ChatSettings, on_text) -> object:
        """Stream a raw-text continuation of `prompt`."""

    def info_rows(self) -> list[list[str]]: ...

    def stream_line(self) -> str | None: ...


class LocalModel:
    """A model loaded here, one Session keeping the conversation's KV cache; answers
    guess tokens with `drafter` (runtime/speculative.py) if given."""

    def __init__(self, name: str, lm: LoadedModel, drafter: Drafter | None = None):
        from ..runtime.session import Session

        self.name, self.lm = name, lm
        self.session = Session(lm.model, stages=lm.stages)
        self.drafter = drafter

    def answer(self, messages, settings, on_text, on_thought=None):
        from ..runtime.conversation import answer_turn
        from ..runtime.generate import Penalties
        from ..runtime.model.thinking import ThoughtSplitter, opens_thought, split_thoughts

        tok, variables = self.lm.tokenizer, settings.template_vars()
        splitter = shown = None
        if tok.thinks:  # the thoughts apart, as the server gives them
            prompt = tok.apply_chat_template(messages, True, None, variables)
            # a constrained answer is the grammar's from its first token: no thought open
            constrained = settings.format is not None or settings.grammar is not None
            inside = not constrained and opens_thought(prompt[-32:])
            splitter, shown = ThoughtSplitter(inside), on_text

            def on_text(piece: str) -> None:
                thought, text = splitter.feed(piece)
                if thought and on_thought:
                    on_thought(thought)
                if text:
                    shown(text)

        penalties = Penalties(repeat=settings.repeat_penalty)
        answer, dropped = answer_turn(
            self.session, tok, messages, settings.sampler, settings.max_tokens, on_text,
            penalties, constraint=self._constraint(settings), drafter=self.drafter,
            variables=variables,
        )  # fmt: skip
        if splitter is not None:
            thought, text = splitter.finish()
            if thought and on_thought:
                on_thought(thought)
            if text:
                shown(text)
            answer.thinking, answer.text = split_thoughts(answer.text, inside)
        return answer, dropped

    def complete(self, prompt: str, settings, on_text):
        """Continue `prompt` as raw text, no chat template."""
        from ..runtime.answer import stream_answer
        from ..runtime.generate import Penalties

        ids = self.lm.tokenizer.encode(prompt)
        penalties = Penalties(repeat=settings.repeat_penalty)
        return stream_answer(
            self.session, self.lm.tokenizer, ids, settings.sampler, settings.max_tokens,
            on_text, penalties, constraint=self._constraint(settings), drafter=self.drafter,
        )  # fmt: skip

    def _constraint(self, settings):
        """The grammar of settings.format (or .grammar) for one answer, or None."""
        from ..runtime.structured import compile_format, compile_grammar

        if settings.format is not None:
            return compile_format(self.lm.tokenizer, settings.format).matcher()
        if settings.grammar is not None:
            return compile_grammar(self.lm.tokenizer, settings.grammar).matcher()
        return None

    def info_rows(self) -> list[list[str]]:
        ctx, source = self.lm.model.max_seq_len, self.lm.source
        a = source.args
        archs = ", ".join(source.config.get("architectures") or ["?"])
        trained = f" (trained on {a.max_seq_len})" if a.max_seq_len != ctx else ""
        return [  # as `infer info` prints them
            ["architecture", f"{a.model_type} ({archs})"],
            ["parameters", f"{human_count(a.n_params)} ({a.n_params:,})"],
            ["context length", f"{ctx}{trained}"],
            ["quantization", source.quantization],
        ]

    def stream_line(self) -> str | None:
        return stream_line(self.lm)


@dataclass
class Chat:
    """What the commands act on: the model, the settings, the conversation so far."""

    model: ChatModel
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
    elif what in ("think", "nothink") and not rest.strip():
        chat.settings.think = what == "think"  # a thinking model's switch, as --[no-]think
        print(f"(set {what} mode)", file=sys.stderr)
    elif what == "parameter" and len(rest.split()) == 2:
        name, value = rest.split()
        try:
            chat.settings.set_parameter(name, value)
        except ValueError as err:
            raise CommandError(str(err)) from None
        print(f"(set {name} to {value})", file=sys.stderr)
    else:
        raise CommandError("usage: /set system TEXT, /set parameter NAME VALUE, /set [no]think")


def _show(chat: Chat, arg: str) -> None:
    if arg == "info":
        print_table(None, chat.model.info_rows())
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


def chat_loop(model: ChatModel, settings: ChatSettings) -> None:
    """Read messages at a `>>> ` prompt and stream answers until /exit or Ctrl-D."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # not on Windows; input() still works without it
        pass

    chat = Chat(model, settings)
    chat.restart()
    out = sys.stdout
    if out.isatty():
        import shutil

        wrap = WordWrap(out, shutil.get_terminal_size().columns)
        show = wrap.write
    else:
        wrap = None

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

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
        thoughts = ThoughtDisplay(out, show if out.isatty() else None)
        try:
            answer, dropped = model.answer(messages, settings, thoughts.then(show), thoughts)
        except InferError as err:  # e.g. one message longer than the context
            messages.pop()
            print(f"error: {err}", file=sys.stderr)
            continue
        finally:
            thoughts.end()
            if wrap is not None:
                wrap.flush()
        if dropped:
            print("(oldest messages dropped to fit the context)", file=sys.stderr)
        if answer.finish_reason == "interrupted" and not answer.text:
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
            if line := model.stream_line():
                print(line, file=sys.stderr)
        print(file=out, flush=True)  # a blank line before the next prompt
