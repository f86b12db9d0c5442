"""The `infer` command end to end, each call a subprocess as a user would run it."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

QUESTION = "What is the capital of France?"
GREEDY = ["--temperature", "0"]
TIMING_KEYS = {"load_s", "ttft_s", "prefill_tok_s", "decode_s", "decode_tok_s"}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "INFER_DEBUG"}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


def infer(*args, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `infer ARGS` with stdin a pipe (never the test runner's terminal).
    Lone surrogates in ARGS or stdin ("\udce9") go as the bytes they escape (0xe9)."""
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", *map(str, args)],
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        errors="surrogateescape",
        env=env or _env(),
        timeout=300,
    )


def assert_one_line_error(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert r.returncode == code, r.stderr
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def home(tmp_path_factory, smollm2_gguf) -> Path:
    """An INFER_HOME whose cache holds the default model (a link to the real file)."""
    home = tmp_path_factory.mktemp("infer_home")
    folder = home / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf.resolve())
    (home / "hf").mkdir()
    return home


@pytest.fixture(scope="module")
def home_env(home) -> dict:
    return _env(INFER_HOME=str(home), HF_HUB_CACHE=str(home / "hf"))


# ---------------------------------------------------------------------------- no model


def test_help_is_fast_and_lists_commands():
    t0 = time.perf_counter()
    r = infer("--help")
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0
    for command in ("run", "pull", "list", "info", "bench"):
        assert command in r.stdout
    assert elapsed < 5  # typically ~0.2 s; generous for a loaded machine
    # The reason it is fast: nothing heavy is imported until a command runs.
    code = "import sys, infer.cli.main; assert 'torch' not in sys.modules, 'torch imported'"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_each_command_has_a_one_line_summary():
    # `infer --help` lists each command by its docstring's first paragraph, line breaks kept
    from infer.cli.main import app

    for info in app.registered_commands:
        doc = (info.callback.__doc__ or "").strip()
        assert doc and "\n" not in doc.split("\n\n")[0], info.callback.__name__


def test_serve_says_in_one_line_why_a_model_did_not_load(home_env, smollm2_gguf):
    # the server stops before it listens: a GGUF file over the budget cannot stream
    r = infer("serve", smollm2_gguf, "--max-memory", "100MB", "-np", "1", "--port", "0",
              env=home_env)  # fmt: skip
    assert_one_line_error(r, 2, "over the budget of 100.00 MB", "infer quantize")
    r = infer("serve", smollm2_gguf, "--max-memory", "1MB", "--port", "0", env=home_env)
    assert_one_line_error(r, 2, "--max-memory 1.00 MB does not hold its 4 slots'")
    # under a budget it fits in, it loads resident and answers as without one
    plain = infer("run", smollm2_gguf, "Say hi.", *GREEDY, "-n", "4", env=home_env)
    budgeted = infer("run", smollm2_gguf, "Say hi.", *GREEDY, "-n", "4", "--max-memory", "8GB",
                     env=home_env)  # fmt: skip
    assert budgeted.returncode == 0 and budgeted.stdout == plain.stdout, budgeted.stderr


def test_serve_refuses_a_bad_cache_size():
    assert_one_line_error(infer("serve", "--cache-ram", "lots"), 2, "--cache-ram")


def test_version():
    r = infer("--version")
    assert r.returncode == 0 and r.stdout.startswith("infer ")


def test_usage_error_exits_2():
    assert infer("run", "--temperature", "hot").returncode == 2
    assert infer("frobnicate").returncode == 2


def test_unexpected_exception_is_one_line_and_exit_1():
    code = (
        "import sys; import infer.runtime.registry as reg; from infer.cli.main import main\n"
        "def boom(): raise RuntimeError('disk on fire')\n"
        "reg.list_cached = boom; sys.argv = ['infer', 'list']; main()"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=_env()
    )
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        "error: RuntimeError: disk on fire (--debug shows the traceback)"
    ]


# ------------------------------------------------------------------------------ errors


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    import numpy as np
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("bad")
    truncated = root / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))

    llama_config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "vocab_size": 300,
    }
    corrupt = root / "corrupt_safetensors"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(json.dumps(llama_config))
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 8 + b"not json at all" * 10)

    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64})
    )
    save_file({"wte.weight": np.zeros((4, 4), np.float32)}, str(gpt2 / "model.safetensors"))
    return {"truncated": truncated, "corrupt": corrupt, "gpt2": gpt2, "missing": root / "no.gguf"}


@pytest.mark.parametrize(
    "case, words",
    [
        ("unknown", ["unknown model 'smollm2-135'", "did you mean smollm2-135m"]),
        ("missing", ["no such file", "no.gguf"]),
        ("truncated", ["truncated"]),
        # each loads torch in the child: one such case in the fast tier
        pytest.param("corrupt", ["model.safetensors"], marks=pytest.mark.slow),
        pytest.param("gpt2", ["unsupported architecture", "gpt2"], marks=pytest.mark.slow),
    ],
)
def test_bad_model_is_one_line_exit_2(bad_models, case, words):
    model = "smollm2-135" if case == "unknown" else bad_models[case]
    assert_one_line_error(infer("run", model, "Hi"), 2, *words)


def test_empty_prompt_is_an_error(smollm2_gguf):
    assert_one_line_error(infer("run", smollm2_gguf, stdin="  \n"), 2, "empty prompt")


def test_prompt_that_is_not_utf8_is_an_error(smollm2_gguf):
    # 0xe9 is "é" in Latin-1; in UTF-8 it starts a sequence that "\n" or "!" breaks.
    r = infer("run", smollm2_gguf, stdin="caf\udce9\n")
    assert_one_line_error(r, 2, "stdin: not UTF-8 text", "at byte 3")
    r = infer("run", smollm2_gguf, "caf\udce9!")
    assert_one_line_error(r, 2, "PROMPT: not UTF-8 text", "at byte 3")
    r = infer("run", smollm2_gguf, "Hi", "--system", "\udcff")
    assert_one_line_error(r, 2, "--system: not UTF-8 text", "at byte 0")


def test_a_prompt_alone_is_not_taken_for_a_model():
    r = infer("run", "What is the capital of France?")
    assert_one_line_error(r, 2, "MODEL comes before PROMPT")
    assert "infer run smollm2-135m 'What is the capital of France?'" in r.stderr
    # A name, a repo id or a path given alone is a model, and the prompt is missing.
    for model in ("smollm2", "Org/some-model", "./missing.gguf"):
        assert_one_line_error(infer("run", model), 2, "empty prompt")


@pytest.mark.slow
def test_prompt_longer_than_ctx(smollm2_gguf):
    r = infer("run", smollm2_gguf, "word " * 100, "--ctx", "16")
    assert_one_line_error(r, 2, "longer than the context of 16", "--ctx")


@pytest.mark.slow
def test_debug_shows_traceback(bad_models):
    r = infer("run", bad_models["truncated"], "Hi", "--debug")
    assert r.returncode == 2
    assert "Traceback" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: ")
    r = infer("run", "smollm2-135", "Hi", env=_env(INFER_DEBUG="1"))
    assert r.returncode == 2 and "Traceback" in r.stderr


# --------------------------------------------------------------------------- real model


def test_one_shot_and_json_agree(smollm2_gguf, home_env):
    # Plain: only the answer on stdout, newline-terminated, no escape codes, no chatter.
    plain = infer("run", smollm2_gguf, QUESTION, *GREEDY, "-n", "24")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() and plain.stdout.endswith("\n")
    assert "\x1b" not in plain.stdout + plain.stderr
    assert plain.stderr == ""

    # The same prompt piped in, by registry name (through the cache), as JSON.
    r = infer("run", "smollm2", "--json", *GREEDY, "-n", "24", stdin=QUESTION + "\n", env=home_env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) == {
        "model", "text", "tokens_generated", "prompt_tokens", "finish_reason", "timings",
    }  # fmt: skip
    assert set(data["timings"]) == TIMING_KEYS
    assert data["model"] == "smollm2-135m"
    assert data["text"] == plain.stdout.removesuffix("\n")  # greedy is deterministic
    assert data["finish_reason"] in ("stop", "length")
    if data["finish_reason"] == "stop":
        assert 0 < data["tokens_generated"] < 24
    else:
        assert data["tokens_generated"] == 24
    assert data["prompt_tokens"] > 10  # the chat template wraps the question
    t = data["timings"]
    assert t["load_s"] > 0 and t["ttft_s"] > 0 and t["prefill_tok_s"] > 0
    assert t["decode_tok_s"] > 0


@pytest.mark.slow  # a child process per case
def test_reader_that_leaves_early_ends_it_quietly(smollm2_gguf):
    # As `infer run ... | head -n 1`: the pipe closes while the answer still streams.
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.cli.main", "run", smollm2_gguf, "1\n2\n3\n4\n",
         "--no-chat", "-n", "200", *GREEDY],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
    )  # fmt: skip
    proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 141), stderr
    assert stderr == ""


@pytest.mark.slow
def test_no_chat_prompt_plus_stdin_and_max_tokens(smollm2_gguf):
    from infer.runtime.files.gguf import GGUFFile
    from infer.runtime.model.tokenizer import Tokenizer

    r = infer(
        "run", smollm2_gguf, "Counting: 1, 2, 3,", "--no-chat", "-n", "5", "--json", *GREEDY,
        stdin="4, 5, 6,\n",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["finish_reason"] == "length"
    assert data["tokens_generated"] == 5
    # PROMPT, a blank line, then stdin; raw text, no template.
    tok = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_gguf).metadata)
    assert data["prompt_tokens"] == len(tok.encode("Counting: 1, 2, 3,\n\n4, 5, 6,"))
    assert data["text"].strip().startswith("7")


@pytest.mark.slow
def test_max_tokens_minus_one_fills_the_context(smollm2_gguf):
    r = infer(
        "run", smollm2_gguf, "Counting: 1, 2, 3,", "--no-chat", "-n", "-1", "--ctx", "40",
        "--json", *GREEDY,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["finish_reason"] == "length"
    # The last token is sampled, never fed back, so it needs no place in the context.
    assert data["prompt_tokens"] + data["tokens_generated"] == 40 + 1
    assert r.stderr == "note: the context of 40 tokens is full (raise --ctx)\n"


@pytest.mark.slow  # a child process per case
def test_a_full_context_is_said_on_stderr(smollm2_gguf):
    r = infer("run", smollm2_gguf, "Counting: 1, 2, 3,", "--no-chat", "-n", "100", "--ctx", "24")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")  # the answer, as ever
    assert r.stderr == "note: the context of 24 tokens is full (raise --ctx)\n"


@pytest.mark.slow  # a child process per case
def test_ctx_beyond_the_trained_context_warns(smollm2_gguf):
    r = infer("run", smollm2_gguf, "Hi", "-n", "4", "--ctx", "100000", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens_generated"] > 0
    assert r.stderr == (
        f"warning: --ctx 100000 is more than the 8192 tokens {smollm2_gguf.stem} "
        "was trained on; using 8192\n"
    )


@pytest.mark.slow
def test_info(smollm2_gguf):
    r = infer("info", smollm2_gguf, "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["architecture"] == "llama"
    assert (data["layers"], data["hidden_size"], data["heads"], data["kv_heads"]) == (30, 576, 9, 3)
    assert data["vocab_size"] == 49152 and data["context_length"] == 8192
    assert data["quantization"] == "Q4_1"
    assert data["file_bytes"] == smollm2_gguf.stat().st_size
    assert 130e6 < data["parameters"] < 140e6
    r = infer("info", smollm2_gguf)
    assert r.returncode == 0 and "\x1b" not in r.stdout
    assert "Q4_1" in r.stdout and "layers" in r.stdout


def test_list_and_info_import_neither_torch_nor_numpy(home_env):
    """`infer list` and `infer info` read headers alone (runtime/files/model_file.py):
    importing torch, or numpy, is most of the seconds they took."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted({'torch', 'numpy'} & sys.modules.keys())))\n"
        "from infer.cli import main\n"
        "main()\n"
    )
    for args in (["list"], ["list", "--all"], ["list", "--json"], ["info"], ["info", "--json"]):
        r = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=home_env,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == "[]", (args, r.stdout[-500:])


@pytest.mark.slow
def test_list_and_pull_from_cache(home, home_env, tmp_path):
    r = infer("list", env=home_env)
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "SIZE", "FORMAT"]
    assert row.split()[0] == "smollm2-135m" and "gguf" in row.split()
    entries = json.loads(infer("list", "--json", env=home_env).stdout)
    assert [(e["name"], e["format"]) for e in entries] == [("smollm2-135m", "gguf")]

    r = infer("pull", "smollm2", env=home_env)  # cached: nothing to fetch
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).parent == home / "models" / "smollm2-135m"

    empty = _env(INFER_HOME=str(tmp_path), HF_HUB_CACHE=str(tmp_path / "hf"))
    r = infer("list", env=empty)
    assert r.returncode == 0 and r.stdout == "" and "infer pull" in r.stderr


# --------------------------------------------------------------------------- interactive


class Terminal:
    """`infer run` on a pseudo-terminal, so it starts the interactive chat."""

    def __init__(self, *args):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infer.cli.main", *map(str, args)],
            stdin=slave, stdout=slave, stderr=slave, env=_env(TERM="dumb"), close_fds=True,
        )  # fmt: skip
        os.close(slave)
        self.out = ""

    def read_until(self, text: str, start: int, timeout: float = 120) -> str:
        """Output from `start` once `text` appears after it."""
        deadline = time.monotonic() + timeout
        while text not in self.out[start:]:
            assert time.monotonic() < deadline, f"no {text!r} in {self.out[start:]!r}"
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    self.out += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # EIO: the child closed the terminal
                    assert self.proc.poll() is not None
        return self.out[start:]

    def send(self, text: str) -> int:
        mark = len(self.out)
        os.write(self.master, text.encode())
        return mark

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        os.close(self.master)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.mark.slow
def test_interactive_chat(smollm2_gguf):
    with Terminal("run", smollm2_gguf, *GREEDY, "-n", "300", "--verbose") as term:
        term.read_until(">>> ", 0)
        mark = term.send("Write a long story about a dragon.\n")
        term.read_until("\n", mark)  # the echo of the line typed
        term.read_until(" ", len(term.out) + 30)  # some answer has streamed
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C mid-answer
        out = term.read_until(">>> ", mark)
        assert "(stopped)" in out
        first_prompt = int(re.search(r"prompt (\d+) tok", out).group(1))
        mark = term.send("/help\n")
        assert "/reset" in term.read_until(">>> ", mark)
        # The partial answer stays in the conversation: the next turn finds the first
        # question and that answer in the KV cache.
        mark = term.send("Give it a name.\n")
        out = term.read_until(">>> ", mark)
        cached = int(re.search(r"\((\d+) cached\)", out).group(1))
        assert cached > first_prompt + 5
        mark = term.send("/reset\n")
        assert "cleared" in term.read_until(">>> ", mark)
        term.send("\x04")  # Ctrl-D
        assert term.proc.wait(timeout=30) == 0


# ---------------------------------------------------------------------- usage and help


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "-n", "-5"], ["--max-tokens", "-1"]),
        (["run", "--temperature", "-1"], ["--temperature"]),
        (["run", "--top-p", "2"], ["--top-p"]),
        (["run", "-t", "0"], ["--threads"]),
        (["run", "--dtype", "float16"], ["--dtype", "float16"]),
        (["run", "--frobnicate"], ["no such option", "--frobnicate"]),
        (["frobnicate"], ["no such command", "frobnicate"]),
        (["eval"], ["missing argument", "MODEL"]),
    ],
)
def test_usage_error_is_one_line_exit_2(args, words):
    assert_one_line_error(infer(*args), 2, *words)


def test_usage_error_on_a_terminal_keeps_the_usage_line():
    with Terminal("run", "--top-p", "2") as term:
        out = term.read_until("--top-p", 0, timeout=30)
        assert term.proc.wait(timeout=30) == 2
        assert "Usage: infer run" in out


@pytest.mark.parametrize(
    "args, option",
    [
        (["run", "--temp", "-1"], "--temperature"),
        (["run", "-c", "0"], "--ctx"),
        (["run", "--ctx-size", "0"], "--ctx"),
        (["run", "-s", "x"], "--seed"),
        (["eval", "m", "-f", "t.txt", "--ctx-size", "2"], "--ctx"),
    ],
)
def test_llama_cpp_short_forms_are_aliases(args, option):
    # The error names the option the short form stands for.
    assert_one_line_error(infer(*args), 2, f"'{option}'")


@pytest.mark.slow
def test_llama_cpp_short_forms_run(smollm2_gguf):
    prompt = (smollm2_gguf, QUESTION, "-n", "8", "--json")
    short = infer("run", *prompt, "--temp", "0.9", "-s", "7", "-c", "64")
    long = infer("run", *prompt, "--temperature", "0.9", "--seed", "7", "--ctx", "64")
    assert short.returncode == 0, short.stderr
    assert json.loads(short.stdout)["text"] == json.loads(long.stdout)["text"]
    r = infer("run", smollm2_gguf, "word " * 100, "--ctx-size", "16")
    assert_one_line_error(r, 2, "longer than the context of 16")


def test_no_option_name_is_used_twice():
    # Typer (its vendored click) does not warn when two options of a command share a name.
    from typer.main import get_command

    from infer.cli.main import app

    for name, command in get_command(app).commands.items():
        names = ["-h", "--help"]
        for param in command.params:
            names += [*param.opts, *param.secondary_opts]
        assert len(names) == len(set(names)), name


def test_every_command_that_runs_a_model_takes_kv_cache():
    from typer.main import get_command

    from infer.cli.main import app

    commands = get_command(app).commands
    for name in ("run", "bench", "eval", "serve"):
        kv = [p for p in commands[name].params if "--kv-cache" in p.opts]
        assert kv and list(kv[0].type.choices) == ["f32", "bf16", "int8"], name


def test_run_with_an_int8_kv_cache(smollm2_gguf):
    r = infer("run", smollm2_gguf, "Say hi.", *GREEDY, "-n", "6", "--kv-cache", "int8")
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    # with the model as its own draft (a cache of the same format): the same greedy answer
    d = infer("run", smollm2_gguf, "Say hi.", *GREEDY, "-n", "6", "--kv-cache", "int8",
              "--draft", smollm2_gguf)  # fmt: skip
    assert d.returncode == 0 and d.stdout == r.stdout, d.stderr


@pytest.mark.slow  # a child process per case
def test_help_text():
    wide = _env(COLUMNS="250")  # one line per option, so each option's text can be read
    for command in ("run", "bench", "list", "info", "pull", "eval", "quantize"):
        r = infer(command, "--help", env=wide)
        assert r.returncode == 0, r.stderr
        # Flags take no value, so show none; Typer's own --help cannot be told.
        assert all("--help" in line for line in r.stdout.splitlines() if "<bool>" in line)
    force = next(
        line for line in infer("quantize", "-h", env=wide).stdout.splitlines() if "--force" in line
    )
    assert "--output" in force and "DST" not in force
    json_line = next(
        line for line in infer("list", "-h", env=wide).stdout.splitlines() if "--json" in line
    )
    assert "array" in json_line


@pytest.mark.slow  # a child process per case
def test_info_verify(home, home_env, smollm2_gguf, tmp_path):
    r = infer("info", "smollm2", "--verify", env=home_env)
    assert r.returncode == 0, r.stderr
    path = home / "models" / "smollm2-135m" / smollm2_gguf.name
    sha256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # models.toml
    assert r.stdout.splitlines() == [f"{path}: sha256 ok ({sha256})"]
    # A cached file whose bytes are not those recorded when it was fetched.
    bad_home = tmp_path / "home"
    folder = bad_home / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / smollm2_gguf.name).write_bytes(b"GGUF damaged")
    (folder / "source.json").write_text(json.dumps({"file": smollm2_gguf.name, "sha256": "0" * 64}))
    env = _env(INFER_HOME=str(bad_home), HF_HUB_CACHE=str(tmp_path / "hf"))
    assert_one_line_error(
        infer("info", "smollm2", "--verify", env=env), 2, "sha256 mismatch", "0" * 64
    )


# ------------------------------------------------------------------------ chat commands


class Chat(Terminal):
    """`infer run` chatting on a pseudo-terminal, one line at a time."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read_until(">>> ", 0)

    def say(self, line: str) -> str:
        """What the chat prints for `line`, up to its next prompt."""
        mark = self.send(line + "\n")
        self.read_until("\n", mark)  # the echo of the line typed (readline may shorten it)
        return self.read_until(">>> ", self.out.index("\n", mark) + 1)


def _prompt_tokens(out: str) -> int:
    return int(re.search(r"prompt (\d+) tok", out).group(1))


@pytest.mark.slow  # a child process per case
def test_chat_commands_send_nothing_to_the_model(smollm2_gguf):
    with Chat("run", smollm2_gguf, *GREEDY, "-n", "2", "--verbose") as chat:
        assert "/set parameter" in chat.say("/help")
        info = chat.say("/show info")
        assert "llama" in info and "Q4_1" in info and "context length" in info
        # An unknown command, even with words after it, never reaches the model.
        out = chat.say("/frobnicate the model")
        assert "unknown command /frobnicate; /help lists them" in out
        assert "prompt" not in out
        out = chat.say("/set parameter temperature hot")
        assert "temperature must be" in out and "prompt" not in out
        assert "unknown parameter" in chat.say("/set parameter warmth 1")
        out = chat.say("/set parameter top_k 7")
        assert "prompt" not in out
        assert re.search(r"top_k +7", chat.say("/show parameters"))
        assert re.search(r"temperature +0\.0", chat.say("/show parameters"))
        assert "usage: /show" in chat.say("/show everything")
        assert "(no system message)" in chat.say("/show system")
        # Two slashes: a message.
        assert "prompt" in chat.say("//frobnicate")
        chat.send("/exit\n")
        assert chat.proc.wait(timeout=30) == 0


@pytest.mark.slow  # a child process
def test_chat_set_think_and_nothink(tmp_path):
    """/set nothink writes Qwen3's empty thought into the next prompt (19 tokens, one a
    byte, on this tiny model's template), /set think takes it out again."""
    from tiny import HERMES, make_hf_model, set_chat_template

    make_hf_model("qwen2", tmp_path / "m")
    set_chat_template(tmp_path / "m", HERMES)
    with Chat("run", tmp_path / "m", *GREEDY, "-n", "1", "--verbose") as chat:
        plain = _prompt_tokens(chat.say("/clear") and chat.say("Hi"))
        assert "(set nothink mode)" in chat.say("/set nothink")
        assert _prompt_tokens(chat.say("/clear") and chat.say("Hi")) == plain + 19
        assert "(set think mode)" in chat.say("/set think")
        assert _prompt_tokens(chat.say("/clear") and chat.say("Hi")) == plain
        assert "usage: /set" in chat.say("/set think hard")
        chat.send("/bye\n")
        assert chat.proc.wait(timeout=30) == 0


@pytest.mark.slow  # a child process per case
def test_chat_set_system_parameter_and_clear(smollm2_gguf):
    with Chat("run", smollm2_gguf, *GREEDY, "-n", "2", "--verbose") as chat:
        first = _prompt_tokens(chat.say("Hi"))
        assert _prompt_tokens(chat.say("Hi")) > first  # the conversation goes on
        assert "cleared" in chat.say("/clear")
        assert _prompt_tokens(chat.say("Hi")) == first
        # A new system message reaches the template, and the conversation restarts.
        system = "You answer in one word, like a pirate. " * 5
        assert "cleared" in chat.say("/set system " + system)
        assert system.strip() in chat.say("/show system")
        assert _prompt_tokens(chat.say("Hi")) > first
        assert "cleared" in chat.say("/reset")
        system_first = _prompt_tokens(chat.say("Hi"))
        assert system_first > first
        # num_predict is -n: the next answer has one token.
        chat.say("/set parameter num_predict 1")
        assert "generated 1 tok" in chat.say("Tell me a story.")
        chat.send("\x04")  # Ctrl-D
        assert chat.proc.wait(timeout=30) == 0


@pytest.mark.slow  # child processes
def test_embed(smollm2_gguf):
    """`infer embed`: one JSON array a line, each text's pooled state at unit length (the
    runtime's embedding); stdin lines when no TEXT; --json; no text is a one-line error."""
    from infer.runtime.embedding import embed
    from infer.runtime.loader import load_model
    from infer.runtime.session import Session

    lm = load_model(smollm2_gguf)
    want = [
        embed(Session(lm.model), lm.tokenizer.encode_embedded(t), "mean")
        for t in ("a cat", "a dog")
    ]
    r = infer("embed", smollm2_gguf, "a cat", "a dog")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(got) == 2 and all(
        max(abs(x - y) for x, y in zip(g, w)) < 1e-5 for g, w in zip(got, want)
    )
    r = infer("embed", smollm2_gguf, "--json", stdin="a cat\n\na dog\n")
    data = json.loads(r.stdout)
    assert len(data["embeddings"]) == 2 and data["prompt_tokens"] > 0
    assert_one_line_error(infer("embed", smollm2_gguf), 2, "no text")
