"""`infer serve` over HTTP: a server subprocess on a free loopback port, spoken to with
the `openai` package (the OpenAI API) and plain httpx (the ollama API), checked against
the same model answering in-process.

Every request goes to 127.0.0.1 with a timeout; each server stops on SIGTERM and must
exit 0.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tiny import FIM, HERMES, MISTRAL, MISTRAL_TOKENS, THINKER, make_hf_model, set_chat_template

MODEL = "smollm2-135m"
KEY = "sk-test-123"
CTX = 512  # small, so that a prompt longer than the context is cheap to send
TIMEOUT = 60.0  # seconds: any one request
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# About 160 tokens that two requests share, for the prefix cache.
SYSTEM = " ".join(f"Rule {i}: answer briefly, politely and in plain English." for i in range(12))


# -- the servers ------------------------------------------------------------------------


class Server:
    """`infer serve ARGS` in a subprocess, its stderr in a file; `ready()` waits for it."""

    def __init__(self, args: list[str], home: Path, log: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("INFER_DEBUG", "INFER_API_KEY")}
        env.update(INFER_HOME=str(home), HF_HUB_OFFLINE="1")
        self.log = log
        with log.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "infer.cli.main", "serve", *args, "--port", "0"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=env,
            )
        self.url = ""

    def ready(self, timeout: float = 120) -> Server:
        """Poll the log for the address line, then /health answers."""
        deadline = time.monotonic() + timeout
        while not self.url and time.monotonic() < deadline:
            m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", self.log.read_text())
            if m and httpx.get(m[1] + "/health", timeout=5).status_code == 200:
                self.url = m[1]
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.1)
        if not self.url:
            self.kill()
            pytest.fail(f"the server did not start:\n{self.log.read_text()}")
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 20) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds it took)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the server ignored SIGTERM for {timeout} s:\n{self.log.read_text()}")
        return code, time.monotonic() - t0


@pytest.fixture(scope="module")
def home(tmp_path_factory, smollm2_gguf) -> Path:
    """An INFER_HOME whose cache holds only the default model (a link to the real file)."""
    home = tmp_path_factory.mktemp("infer_home")
    folder = home / "models" / MODEL
    folder.mkdir(parents=True)
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf.resolve())
    return home


def _same_file(src: Path, dst: Path) -> Path:
    """`dst` as another name of `src`: a hard link where it can be, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_gguf) -> dict[str, Path]:
    """The model under a folder the server serves, outside it, and linked into it."""
    root = tmp_path_factory.mktemp("files")
    files = {
        "dir": root / "served",
        "inside": _same_file(smollm2_gguf, root / "served" / "sub" / "model.gguf"),
        "outside": _same_file(smollm2_gguf, root / "elsewhere" / "model.gguf"),
        "link": root / "served" / "link.gguf",
    }
    files["link"].symlink_to(files["outside"])
    # A tiny random code model, served by path: its template offers tools (Hermes style),
    # its vocabulary has fill-in-the-middle tokens.
    files["tools"] = root / "served" / "coder"
    make_hf_model("qwen2", files["tools"], specials=FIM, max_position_embeddings=1024)
    set_chat_template(files["tools"], HERMES)
    # A thinking model whose template opens the thought (as QwQ's and DeepSeek-R1's do).
    files["thinker"] = root / "served" / "thinker"
    make_hf_model("qwen2", files["thinker"], seed=1)
    set_chat_template(files["thinker"], THINKER)
    # Mistral's tool calls: [TOOL_CALLS] lists, call ids of 9 characters.
    files["mistral"] = root / "served" / "mistral"
    make_hf_model(
        "qwen2", files["mistral"], seed=2, specials=MISTRAL_TOKENS, max_position_embeddings=1024
    )
    set_chat_template(files["mistral"], MISTRAL)
    return files


@pytest.fixture(scope="module")
def launched(home, files, tmp_path_factory):
    """Both servers, started together so that their start-ups overlap: the main one, and
    one with an API key that a test stops mid-answer."""
    log = tmp_path_factory.mktemp("log")
    servers = {
        "main": Server(
            [MODEL, "--ctx", str(CTX), "--models-dir", str(files["dir"]), "--parallel", "2"],
            home,
            log / "main.log",
        ),
        # One slot (--slots: the old spelling of --parallel): a second answer waits.
        # Its draft model is the same file under another name: loaded a second time.
        "keyed": Server(
            [MODEL, "--ctx", str(CTX), "--api-key", KEY, "--slots", "1"]
            + ["--draft", str(files["outside"])],
            home,
            log / "keyed.log",
        ),
        # Two slots of int8 KV caches.
        "int8": Server(
            [MODEL, "--ctx", str(CTX), "--parallel", "2", "--kv-cache", "int8"]
            + ["--cors-origin", "https://app.example"],
            home,
            log / "int8.log",
        ),
    }
    yield servers
    for s in servers.values():
        s.kill()


@pytest.fixture(scope="module")
def server(launched, greedy):
    s = launched["main"].ready()  # `greedy` loaded meanwhile
    yield s
    code, _ = s.stop()
    assert code == 0, s.log.read_text()
    assert "Traceback" not in s.log.read_text()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0
    )


@pytest.fixture(scope="module")
def greedy(smollm2_gguf):
    """The answer `infer run MODEL --temp 0` gives, computed in this process."""
    from infer.runtime.answer import stream_answer
    from infer.runtime.generate import make_sampler
    from infer.runtime.loader import load_model
    from infer.runtime.session import Session

    lm = load_model(smollm2_gguf, max_seq_len=CTX)

    def answer(messages: list[dict], n: int) -> str:
        ids = lm.tokenizer.encode_chat(messages)
        session = Session(lm.model, CTX)
        return stream_answer(session, lm.tokenizer, ids, make_sampler(0), n, lambda _: None).text

    return answer


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics as {'name{labels}': value}, checking that every sample has its TYPE."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    typed, out = set(), {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            family = re.sub(r"(_bucket|_sum|_count)$", "", key.split("{")[0])
            assert family in typed, line
            out[key] = float(value)
    return out


def ndjson(r: httpx.Response) -> list[dict]:
    assert r.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in r.iter_lines() if line]


def ollama(http: httpx.Client, path: str, body: dict) -> list[dict]:
    """An ollama streaming request's lines (checked to end with one `done`)."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = ndjson(r)
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    return lines


def generates(http: httpx.Client) -> bool:
    r = http.post(
        "/api/generate", json={"prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
    )
    return r.status_code == 200 and r.json()["eval_count"] == 1


def wait_for(condition, timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- the OpenAI API ---------------------------------------------------------------------


def test_chat_greedy_equals_in_process(oai, greedy):
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy(QUESTION, 12)
    assert "Paris" in choice.message.content
    assert r.object == "chat.completion" and r.model == MODEL
    u = r.usage
    assert u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert choice.finish_reason == ("length" if u.completion_tokens == 12 else "stop")


def test_chat_stream(oai, greedy):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(QUESTION, 4)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and not any(reasons[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1]  # the last chunk: no choices, the usage
    assert usage.choices == [] and usage.usage.completion_tokens == 4


def test_n_answers(oai, greedy):
    # Three answers to one prompt on two slots: decoded together, the third after a slot frees.
    r = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, n=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [greedy(QUESTION, 6)] * 3
    one = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    # Sampled with a seed, answer i is the answer a request with seed + i gives alone.
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 1.5}
    many = oai.chat.completions.create(**ask, seed=11, n=3)
    alone = [oai.chat.completions.create(**ask, seed=11 + i) for i in range(3)]
    assert [c.message.content for c in many.choices] == [
        a.choices[0].message.content for a in alone
    ]
    assert len({c.message.content for c in many.choices}) > 1


def test_n_answers_streamed(oai, greedy):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, n=2, stream=True,
            stream_options={"include_usage": True}, logprobs=True,
        )
    )  # fmt: skip
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == greedy(QUESTION, 5)
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
        assert sum(len(c.logprobs.content) for c in mine if c.logprobs) == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_answers_completions_and_formats(oai):
    r = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    # each answer keeps to the schema on its own
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.7, seed=5, max_tokens=200, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )  # fmt: skip
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_chat_stream_without_usage(oai):
    chunks = list(
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, stream=True)
    )
    assert all(c.usage is None and c.choices for c in chunks)


def test_completions(oai):
    prompt = "The capital of France is"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert "Paris" in r.choices[0].text
    streamed = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_logit_bias(oai, http, smollm2_gguf):
    """logit_bias: +100 makes a token the greedy answer's first, -100 keeps it out."""
    from infer.runtime.files.sources import open_source

    tok = open_source(smollm2_gguf).tokenizer()
    (yes,) = tok.encode("Yes", add_special=False)

    def first(bias: dict) -> str:
        r = oai.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=1, temperature=0, logit_bias=bias
        )
        return r.choices[0].message.content

    plain = first({})
    assert first({str(yes): 100}) == "Yes" != plain
    (top,) = tok.encode(plain, add_special=False)
    assert first({str(top): -100}) != plain
    for bad in ({"x": 1}, {"5": 101}, {str(tok.vocab_size): 1}):
        body = {"model": MODEL, "messages": QUESTION, "logit_bias": bad}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "logit_bias" in r.text, r.text


def test_developer_messages_are_system_messages(http):
    """OpenAI's "developer" role reaches the template as "system" (a role a template does
    not know would be left out, or refused)."""
    counts = []
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Answer in French."}, *QUESTION]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        counts.append(http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"])
    assert counts[0] == counts[1]
    # without it, the template writes its own default system prompt: another length
    body["messages"] = QUESTION
    assert (
        http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"] != counts[0]
    )


def test_logprobs(oai, http, greedy):
    """Each answer token's log probability and top alternatives, in all three shapes
    (chat, legacy completions, ollama), streamed or not: greedy takes the top one, and the
    tokens spell the answer."""
    r = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content == greedy(QUESTION, 6)
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True
        )
    streamed = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    tokens = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in tokens] == [t.token for t in content] and not tokens[0].top_logprobs
    legacy = oai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=2
    ).choices[0]
    assert "".join(legacy.logprobs.tokens) == legacy.text and legacy.logprobs.text_offset[0] == 0
    assert all(len(top) == 2 for top in legacy.logprobs.top_logprobs)
    body = {"model": MODEL, "messages": QUESTION, "stream": False, "logprobs": True}
    r = http.post("/api/chat", json={**body, "options": {"num_predict": 4, "temperature": 0}})
    assert [t["token"] for t in r.json()["logprobs"]] == [t.token for t in content[:4]]
    r = http.post("/v1/chat/completions", json={**body, "top_logprobs": 21})
    assert r.status_code == 400 and "top_logprobs" in r.text
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert r.choices[0].logprobs is None  # not asked for


def test_cors(http, launched):
    """Web pages served from this machine, apps' webviews and browser extensions may call
    the server from a browser (preflight and answers carry their origin); other sites
    may not, unless --cors-origin names them; a preflight needs no API key."""
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }

    def allowed(client: httpx.Client, origin: str, headers=None) -> bool:
        r = client.options(
            "/v1/chat/completions", headers={"Origin": origin, **preflight, **(headers or {})}
        )
        ok = r.headers.get("access-control-allow-origin") == origin
        assert ok == (r.status_code == 200), (origin, r.status_code, r.text)
        got = client.get("/api/version", headers={"Origin": origin})
        assert (
            got.status_code == 200
            and (got.headers.get("access-control-allow-origin") == origin) == ok
        )
        return ok

    for origin in (
        "http://localhost:3000",
        "http://127.0.0.1:8080",
        "chrome-extension://abcdef",
        "app://obsidian.md",
    ):
        assert allowed(http, origin), origin
    assert not allowed(http, "https://evil.example")
    assert not allowed(http, "https://app.example")
    with httpx.Client(base_url=launched["int8"].ready().url, timeout=TIMEOUT) as other:
        assert allowed(other, "https://app.example")  # --cors-origin
        assert not allowed(other, "https://evil.example")
    with httpx.Client(base_url=launched["keyed"].ready().url, timeout=TIMEOUT) as keyed:
        origin = {"Origin": "http://localhost:3000"}
        r = keyed.options("/v1/chat/completions", headers={**origin, **preflight})  # no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin["Origin"]
        r = keyed.get("/v1/models", headers=origin)  # refused, and the page can read why
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin["Origin"]


def test_models_list(oai, files):
    assert MODEL in [m.id for m in oai.models.list()]
    assert oai.models.retrieve(MODEL).id == MODEL
    assert oai.models.retrieve(str(files["tools"])).id == str(files["tools"])  # by path
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(str(files["outside"]))  # a file the server may not read


def test_stop_string_never_shown(oai, http, greedy):
    full = greedy(QUESTION, 12)
    assert "Paris" in full
    r = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stop=["Paris"]
    )
    assert r.choices[0].message.content == full[: full.index("Paris")]
    assert r.choices[0].finish_reason == "stop"
    # Streamed, with a stop string that spans tokens ("is Paris"), and the ollama spelling.
    stream = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=0, stop="is Paris", stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full[: full.index("is Paris")]
    body = {"messages": QUESTION, "options": {"temperature": 0, "stop": ["Paris"]}}
    lines = ollama(http, "/api/chat", body)
    assert "".join(line["message"]["content"] for line in lines) == full[: full.index("Paris")]


def test_same_seed_same_answer(oai):
    def sample(seed: int) -> str:
        r = oai.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.5, seed=seed
        )
        return r.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))  # the seed is used


def test_prefix_cache(oai, http, greedy):
    """A second request sharing a long system prompt computes only its own part, and
    answers as if it had computed everything."""

    def messages(question: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    def ask(question: str):
        return oai.chat.completions.create(
            model=MODEL, messages=messages(question), max_tokens=6, temperature=0
        )

    first = ask("What is 2 + 2?")
    before = metrics(http)
    second = ask("Name a colour.")
    after = metrics(http)
    system_tokens = first.usage.prompt_tokens - 20  # less the question and the template
    assert first.usage.prompt_tokens_details.cached_tokens < 10
    assert second.usage.prompt_tokens_details.cached_tokens >= system_tokens
    assert second.choices[0].message.content == greedy(messages("Name a colour."), 6)
    cached = after["infer_prompt_tokens_cached_total"] - before["infer_prompt_tokens_cached_total"]
    assert cached == second.usage.prompt_tokens_details.cached_tokens
    hits = "infer_prefix_cache_hits_total"
    assert after[hits] == before[hits] + 1


def test_prompt_cache_keeps_conversations_beyond_the_slots(oai, http, greedy):
    """Three conversations on two slots: the first, given up for the third, is kept in the
    prompt cache, and its next turn computes only its own part."""

    def messages(rules: str, question: str) -> list[dict]:
        system = " ".join(f"Rule {rules}{i}: answer briefly." for i in range(12))
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    def ask(rules: str, question: str):
        return oai.chat.completions.create(
            model=MODEL, messages=messages(rules, question), max_tokens=4, temperature=0
        )

    restored = f'infer_prompt_restored_tokens_total{{model="{MODEL}"}}'
    first = ask("A", "What is 2 + 2?")
    ask("B", "Name a colour."), ask("C", "Name a fruit.")
    before = metrics(http)
    again = ask("A", "Name a city.")
    gained = metrics(http)[restored] - before[restored]
    system_tokens = first.usage.prompt_tokens - 20  # less the question and the template
    assert again.usage.prompt_tokens_details.cached_tokens >= gained >= system_tokens
    assert again.choices[0].message.content == greedy(messages("A", "Name a city."), 4)
    assert before[f'infer_prompt_cache_bytes{{model="{MODEL}"}}'] > 0


def test_concurrent_requests(oai, greedy):
    """Answers decoded together on the two slots, and one queued behind them, do not
    mix: each is the answer alone."""
    from concurrent.futures import ThreadPoolExecutor

    questions = ["What is the capital of Italy?", "Name a fruit.", "What is 3 times 3?"]

    def ask(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(ask, questions))
    assert answers == [greedy([{"role": "user", "content": q}], 8) for q in questions]


def test_answers_run_together(http, server):
    """Two streams at once both run (one decode pass for both), the /metrics gauges say
    so, and closing them frees both slots."""
    prompt = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
    running = f'infer_answers_running{{model="{MODEL}"}}'
    cancelled = _finished(http, "cancelled")
    # Greedy: it counts on for 400 tokens (sampled, it may stop after a few).
    body = {"messages": prompt, "max_tokens": 400, "stream": True, "temperature": 0}
    ollama_body = {"messages": prompt, "options": {"num_predict": 400, "temperature": 0}}
    with (
        http.stream("POST", "/v1/chat/completions", json=body) as first,
        http.stream("POST", "/api/chat", json=ollama_body) as second,
    ):
        data = (line for line in first.iter_lines() if line.startswith("data: "))
        next(data), next(data)  # the role, then the first token
        lines = second.iter_lines()  # one iterator: a dropped one closes the stream
        assert json.loads(next(lines))["done"] is False
        m = metrics(http)
        assert m[running] == 2 and m[f'infer_queue_depth{{model="{MODEL}"}}'] == 0
        # From here on every pass runs both: more answers advanced than passes.
        steps, batched = (
            f'infer_decode_{k}_total{{model="{MODEL}"}}' for k in ("steps", "batched")
        )
        wait_for(lambda: metrics(http)[batched] >= m[batched] + 4, what="two passes")
        now = metrics(http)
        assert now[batched] - m[batched] > now[steps] - m[steps]
        # Each prompt was computed in some prompt pass, alone or beside the other's.
        passes, prompts = (
            f'infer_prompt_{k}_total{{model="{MODEL}"}}' for k in ("passes", "batched")
        )
        assert 1 <= now[passes] <= now[prompts]
    wait_for(lambda: _finished(http, "cancelled") == cancelled + 2, what="both cancelled")
    assert metrics(http)[running] == 0 and generates(http)


# -- the ollama API ---------------------------------------------------------------------

TIMINGS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


def test_ollama_chat(http, greedy):
    body = {"model": MODEL, "messages": QUESTION, "options": {"temperature": 0, "num_predict": 5}}
    lines = ollama(http, "/api/chat", body)
    text = "".join(line["message"]["content"] for line in lines)
    assert text == greedy(QUESTION, 5)
    last = lines[-1]
    assert all(isinstance(last[k], int) for k in TIMINGS), last
    assert last["eval_count"] == 5 and last["done_reason"] == "length"
    assert last["total_duration"] >= last["eval_duration"] > 0
    assert all(line["message"]["role"] == "assistant" and line["model"] == MODEL for line in lines)
    r = http.post("/api/chat", json={**body, "stream": False})
    assert r.status_code == 200 and r.json()["message"]["content"] == text
    assert r.json()["done"] is True and r.json()["eval_count"] == 5


def test_ollama_generate(http, greedy):
    body = {"model": MODEL, "prompt": QUESTION[0]["content"]}
    lines = ollama(http, "/api/generate", {**body, "options": {"temperature": 0, "num_predict": 6}})
    assert "".join(line["response"] for line in lines) == greedy(QUESTION, 6)
    assert all(isinstance(lines[-1][k], int) for k in TIMINGS)
    # Not streamed, sampled with a seed: the same answer twice.
    story = {"prompt": "Tell me a story about a dragon.", "stream": False}
    story["options"] = {"seed": 3, "temperature": 1.2, "num_predict": 10}
    first, again = (http.post("/api/generate", json=story).json() for _ in range(2))
    assert first["response"] and first["response"] == again["response"]
    assert first["done_reason"] == ("length" if first["eval_count"] == 10 else "stop")
    # raw: the prompt as it is, no template
    raw = {"prompt": "The capital of France is", "raw": True, "stream": False}
    raw["options"] = {"temperature": 0, "num_predict": 3}
    assert "Paris" in http.post("/api/generate", json=raw).json()["response"]


def test_ollama_listings(http):
    tags = http.get("/api/tags").json()["models"]
    assert [m["name"] for m in tags] == [MODEL]
    ps = http.get("/api/ps").json()["models"]
    assert MODEL in [m["name"] for m in ps]
    m = next(m for m in ps if m["name"] == MODEL)
    assert m["size"] > 0 and m["context_length"] == CTX and m["expires_at"].endswith("Z")
    show = http.post("/api/show", json={"model": MODEL}).json()
    assert show["details"]["format"] == "gguf" and show["details"]["quantization_level"] == "Q4_1"
    assert show["model_info"]["general.architecture"] == "llama"
    assert "im_start" in show["template"] and show["capabilities"] == ["completion"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", http.get("/api/version").json()["version"])
    assert http.get("/health").json()["status"] == "ok"


def _answers(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("infer_answers_total{"))


def test_metrics_move(http):
    before = metrics(http)
    assert generates(http)
    after = metrics(http)
    key = 'infer_requests_total{path="/api/generate",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert _answers(after) == _answers(before) + 1
    assert after["infer_generated_tokens_total"] == before["infer_generated_tokens_total"] + 1
    count = "infer_time_to_first_token_seconds_count"
    assert after[count] == before[count] + 1
    assert after[f'infer_queue_depth{{model="{MODEL}"}}'] == 0
    assert after["infer_models_loaded"] >= 1


# -- bad requests -----------------------------------------------------------------------

LONG = "word " * (CTX + 50)
HI = [{"role": "user", "content": "Hi"}]

BAD_OPENAI = {  # id: (body, status)
    "malformed JSON": (b"{not json", 400),
    "not an object": (b"[1, 2]", 400),
    "temperature hot": ({"messages": HI, "temperature": "hot"}, 400),
    "max_tokens 0": ({"messages": HI, "max_tokens": 0}, 400),
    "max_completion_tokens -3": ({"messages": HI, "max_completion_tokens": -3}, 400),
    "no messages": ({"model": MODEL}, 400),
    "no role": ({"messages": [{"content": "Hi"}]}, 400),
    "image": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    "stop 5": ({"messages": HI, "stop": 5}, 400),
    "seed 2**70": ({"messages": HI, "seed": 2**70}, 400),
    "repeat_penalty 0": ({"messages": HI, "repeat_penalty": 0}, 400),
    "n 0": ({"messages": HI, "n": 0}, 400),
    "n 17": ({"messages": HI, "n": 17}, 400),
    "unknown model": ({"model": "no-such-model", "messages": HI}, 404),
    "longer than the context": ({"messages": [{"role": "user", "content": LONG}]}, 400),
}

BAD_OLLAMA = {  # id: (path, body, status)
    "malformed JSON": ("/api/chat", b"{not json", 400),
    "messages a string": ("/api/chat", {"messages": "Hi"}, 400),
    "temperature hot": ("/api/chat", {"messages": HI, "options": {"temperature": "hot"}}, 400),
    "options a string": ("/api/chat", {"messages": HI, "options": "fast"}, 400),
    "num_predict 0": ("/api/generate", {"prompt": "Hi", "options": {"num_predict": 0}}, 400),
    "seed 2**70": ("/api/generate", {"prompt": "Hi", "options": {"seed": 2**70}}, 400),
    "num_ctx 8": ("/api/generate", {"prompt": "Hi", "options": {"num_ctx": 8}}, 400),
    "keep_alive soon": ("/api/generate", {"prompt": "Hi", "keep_alive": "soon"}, 400),
    "prompt 5": ("/api/generate", {"prompt": 5}, 400),
    "unknown model": ("/api/generate", {"model": "no-such-model", "prompt": "Hi"}, 404),
    "longer than the context": ("/api/generate", {"prompt": LONG}, 400),
    "show an unknown model": ("/api/show", {"model": "no-such-model"}, 404),
}


BAD_OTHER = {  # id: (path, body, status): embeddings, responses, llama-server's
    "embeddings malformed": ("/v1/embeddings", b"{not json", 400),
    "embeddings input 5": ("/v1/embeddings", {"input": 5}, 400),
    "embeddings ids empty": ("/v1/embeddings", {"input": [[]]}, 400),
    "embeddings dimensions 0": ("/v1/embeddings", {"input": "x", "dimensions": 0}, 400),
    "embeddings unknown model": ("/v1/embeddings", {"model": "no-such-model", "input": "x"}, 404),
    "embed input []": ("/api/embed", {"input": []}, 400),
    "embed num_ctx x": ("/api/embed", {"input": "x", "options": {"num_ctx": "x"}}, 400),
    "embeddings prompt 5": ("/api/embeddings", {"prompt": 5}, 400),
    "responses input 5": ("/v1/responses", {"input": 5}, 400),
    "responses max 0": ("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, 400),
    "responses tools x": ("/v1/responses", {"input": "Hi", "tools": "x"}, 400),
    "responses format xml": ("/v1/responses", {"input": "Hi", "text": {"format": {"type": "xml"}}}, 400),
    "responses call args object": ("/v1/responses", {"input": [{"type": "function_call", "name": "f", "arguments": {}}]}, 400),
    "responses output missing": ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "a"}]}, 400),
    "responses content image": ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400),
    "responses unknown model": ("/v1/responses", {"model": "no-such-model", "input": "Hi"}, 404),
    "responses too long": ("/v1/responses", {"input": LONG}, 400),
    "completion prompt 5": ("/completion", {"prompt": 5}, 400),
    "completion prompt floats": ("/completion", {"prompt": [1.5]}, 400),
    "completion prompts": ("/completion", {"prompt": [[1, 2], [3]]}, 400),
    "completion n_predict 0": ("/completion", {"prompt": "Hi", "n_predict": 0}, 400),
    "completion n_probs 50": ("/completion", {"prompt": "Hi", "n_probs": 50}, 400),
    "completion grammar 5": ("/completion", {"prompt": "Hi", "grammar": 5}, 400),
    "completion json_schema x": ("/completion", {"prompt": "Hi", "json_schema": "x"}, 400),
    "completion ids past vocab": ("/completion", {"prompt": [10**9]}, 400),
    "infill extra x": ("/infill", {"input_prefix": "a", "input_extra": "x"}, 400),
    "infill extra [5]": ("/infill", {"input_prefix": "a", "input_extra": [5]}, 400),
    "tokenize content 5": ("/tokenize", {"content": 5}, 400),
    "detokenize tokens x": ("/detokenize", {"tokens": "x"}, 400),
    "detokenize tokens -1": ("/detokenize", {"tokens": [-1]}, 400),
}  # fmt: skip


@pytest.mark.parametrize("path,body,status", BAD_OTHER.values(), ids=BAD_OTHER.keys())
def test_other_bad_requests(http, path, body, status):
    """Each endpoint's bad input is its API's error with a 4xx, never a 500."""
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err if path.startswith("/api/") else err["message"], r.text
    assert generates(http)


FUZZ_BODIES = {  # a valid body of each endpoint, its length fields kept small
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 1},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    "/v1/embeddings": {"input": ["Hi", "there"]},
    "/api/chat": {"messages": [{"role": "user", "content": "Hi"}], "stream": False, "options": {"num_predict": 1}},
    "/api/generate": {"prompt": "Hi", "stream": False, "options": {"num_predict": 1}},
    "/api/embed": {"input": "Hi"},
    "/completion": {"prompt": "Hi", "n_predict": 1},
    "/tokenize": {"content": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
}  # fmt: skip
KEPT = {"max_tokens", "max_output_tokens", "n_predict", "num_predict", "model", "stream"}
ODD = [None, 0, -1, 1.5, "", "x", [], {}, [1], [[1]], {"a": 1}, True, 10**30, "\x00",
       [{"type": "x"}], [{"role": "user"}], [{"role": "user", "content": [{"type": "x"}]}]]  # fmt: skip


def _odd(rng):
    return json.loads(json.dumps(rng.choice(ODD)))  # a copy: later mutations may change it


def _mutated(body, rng) -> dict:
    """`body` with a few of its fields (at any depth, length fields kept) replaced by odd
    values, removed, or joined by unknown ones."""
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        holder, key = body, rng.choice([k for k in body if k not in KEPT] or ["x"])
        while isinstance(holder.get(key), (dict, list)) and holder[key] and rng.random() < 0.5:
            inner = holder[key]
            holder = inner if isinstance(inner, dict) else inner[0]
            if not isinstance(holder, dict) or not [k for k in holder if k not in KEPT]:
                break
            key = rng.choice([k for k in holder if k not in KEPT])
        if not isinstance(holder, dict):
            continue
        roll = rng.random()
        if roll < 0.2:
            holder.pop(key, None)
        elif roll < 0.3:
            holder[f"unknown_{rng.randint(0, 9)}"] = _odd(rng)
        else:
            holder[key] = _odd(rng)
    return body


def test_random_bodies_never_fail_the_server(http):
    """Seeded random mutations of each endpoint's valid body: a 4xx or an answer, never a
    500, and the server answers after them all."""
    rng = random.Random(7)
    for path, body in FUZZ_BODIES.items():
        for _ in range(15):
            sent = _mutated(body, rng)
            r = http.post(path, json=sent)
            assert r.status_code < 500, (path, sent, r.text)
    assert generates(http)


def _post(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


@pytest.mark.parametrize("body,status", BAD_OPENAI.values(), ids=BAD_OPENAI.keys())
def test_openai_bad_request(http, body, status):
    r = _post(http, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    assert generates(http)  # still serving


def test_error_names_the_field_and_value(http):
    r = http.post("/v1/chat/completions", json={"messages": HI, "temperature": -1})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "temperature"
    assert err["message"] == "temperature must be at least 0, not -1"


def test_openai_bad_completion(http):
    for body in (
        {"prompt": ["a", "b"]},
        {"prompt": ""},
        {"prompt": LONG},
        {"prompt": "x", "max_tokens": 0},
    ):
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
    # Streaming, a bad request is still an error status, not an error inside a stream.
    r = http.post("/v1/chat/completions", json={"messages": HI, "stream": True, "max_tokens": 0})
    assert r.status_code == 400


@pytest.mark.parametrize("path,body,status", BAD_OLLAMA.values(), ids=BAD_OLLAMA.keys())
def test_ollama_bad_request(http, path, body, status):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"]
    assert generates(http)


def test_unusual_values_are_served(http):
    """Extreme but valid settings answer (they once reached the sampler and failed)."""
    for extra in ({"temperature": 1e-300}, {"temperature": 1, "top_p": 0}, {"temperature": 10**30}):
        r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **extra})
        assert r.status_code == 200, (extra, r.text)


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.get("/api/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    assert http.get("/v1/chat/completions").status_code == 405


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _raw(url: str, request: bytes) -> bytes:
    """Send `request` as it is; the response's bytes."""
    with socket.create_connection(_address(url), timeout=TIMEOUT) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/generate"])
def test_body_over_limit(server, http, path):
    # The headers alone announce 32 MiB: refused before any of it is read.
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    response = _raw(
        server.url, (head + "Content-Length: 33554432\r\nConnection: close\r\n\r\n").encode()
    )
    status, _, body = response.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413"), response[:200]
    err = json.loads(body)["error"]
    assert "MiB" in (err if path.startswith("/api/") else err["message"])
    assert generates(http)


# -- the slot, the model, the files -----------------------------------------------------


def _finished(http: httpx.Client, reason: str) -> float:
    return metrics(http).get(f'infer_answers_total{{finish_reason="{reason}"}}', 0)


@pytest.mark.parametrize(
    "api, n", [("openai", 1), ("ollama", 1), ("openai-no-stream", 1), ("openai", 2),
               ("openai-no-stream", 2)],
)  # fmt: skip
def test_disconnect_frees_the_slot(http, server, api, n):
    """A client gone mid-answer cancels it (all n of them): the answers end "cancelled",
    nothing runs or waits any more, and the next request is served."""
    prompt = [{"role": "user", "content": "Count from 1 to 500, one number per line."}]
    cancelled = _finished(http, "cancelled")
    running = f'infer_answers_running{{model="{MODEL}"}}'
    # Greedy, it counts on for 400 tokens; sampled, it may stop before the client goes.
    if api == "openai":
        body = {"messages": prompt, "max_tokens": 400, "stream": True, "temperature": 0, "n": n}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            for _ in range(n + 1):  # the roles, then a first token
                next(data)
            wait_for(lambda: metrics(http)[running] == n, what="the answers to start")
    elif api == "ollama":
        body = {"messages": prompt, "options": {"num_predict": 400, "temperature": 0}}
        with http.stream("POST", "/api/chat", json=body) as r:
            assert json.loads(next(r.iter_lines()))["done"] is False
    else:  # not streamed: the connection closes once the answer is running
        body = {"messages": prompt, "max_tokens": 400, "temperature": 0, "n": n}
        body = json.dumps(body).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}"
        with socket.create_connection(_address(server.url), timeout=TIMEOUT) as s:
            s.sendall(head.encode() + b"\r\nContent-Type: application/json\r\n\r\n" + body)
            wait_for(lambda: metrics(http)[running] == n, what="the answers to start")
    wait_for(lambda: _finished(http, "cancelled") == cancelled + n, what="the cancelled answers")
    m = metrics(http)
    assert m[running] == 0 and m[f'infer_queue_depth{{model="{MODEL}"}}'] == 0
    assert generates(http)


def test_client_gone_before_its_body(server, http):
    """Half a body, then the connection closes: a 499 counted, no error in the log."""
    key = 'infer_requests_total{path="/v1/chat/completions",status="499"}'
    before = metrics(http).get(key, 0)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    with socket.create_connection(_address(server.url), timeout=TIMEOUT) as s:
        s.sendall(head.encode() + b'{"messages":')
    wait_for(lambda: metrics(http).get(key, 0) == before + 1, what="the 499")
    assert "error" not in server.log.read_text()
    assert generates(http)


def test_models_dir_policy(http, files):
    """Files under --models-dir may be named, links put there too; nothing else."""
    body = {"prompt": "Hi", "stream": False, "options": {"num_predict": 1}}
    climbing = files["inside"].parent / ".." / ".." / "elsewhere" / "model.gguf"
    for name in (files["outside"], climbing, "/etc/passwd"):
        r = http.post("/api/generate", json={**body, "model": str(name)})
        assert r.status_code == 404 and "not served" in r.json()["error"], r.text
        assert http.post("/api/show", json={"model": str(name)}).status_code == 404
    for name in (files["inside"], files["link"]):
        r = http.post("/api/generate", json={**body, "model": str(name)})
        assert r.status_code == 200 and r.json()["eval_count"] == 1, r.text
        # Unloaded again, to leave one model for the tests after.
        r = http.post("/api/generate", json={"model": str(name), "keep_alive": 0})
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"


# -- tool calls ---------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NONE = {"type": "object", "properties": {}, "additionalProperties": False}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": NONE}}


def test_tools_need_a_template_that_takes_them(oai, http):
    """The default model's template lists no tools: a clear 400 from both APIs."""
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    r = http.post("/api/chat", json={"model": MODEL, "messages": QUESTION, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"] == f"{MODEL} does not support tools"
    # tool_choice "none" offers no tools: a plain answer
    r = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=2
    )
    assert r.choices[0].message.tool_calls is None


def test_required_tool_call(oai, http, files):
    """tool_choice "required" (or a named tool): the answer is a call, parsed into
    tool_calls (streamed or not), its arguments valid; an earlier call and its result in
    the messages are taken."""
    model = str(files["tools"])
    show = http.post("/api/show", json={"model": model}).json()
    assert show["capabilities"] == ["completion", "tools", "insert", "thinking"]
    messages = [{"role": "user", "content": "Weather?"}]
    for choice, names in (("required", {"get_weather", "get_time"}), (WEATHER, {"get_weather"})):
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": "get_weather"}}
        r = oai.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, CLOCK], tool_choice=choice,
            max_tokens=200, temperature=1.0, seed=3,
        )  # fmt: skip
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None, (c, r.usage)
        (call,) = c.message.tool_calls
        assert call.type == "function" and re.fullmatch("[0-9a-z]{9}", call.id)
        assert call.function.name in names
        if call.function.name == "get_weather":
            jsonschema.validate(
                json.loads(call.function.arguments), WEATHER["function"]["parameters"]
            )
    stream = oai.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], tool_choice="required",
        max_tokens=200, stream=True, temperature=0,
    )  # fmt: skip
    chunks = list(stream)
    assert not any(ch.choices and ch.choices[0].delta.content for ch in chunks)  # never shown
    calls = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert [t.function.name for t in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call and its result, sent back
    args = calls[0].function.arguments
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    r = oai.chat.completions.create(model=model, messages=history, tools=[CLOCK], max_tokens=2)
    assert r.usage.prompt_tokens > len("18 C" + args)
    ollama_history = [*history[:1], {**history[1], "tool_calls": [
        {"function": {"name": "get_weather", "arguments": json.loads(args)}}]}, history[2]]  # fmt: skip
    body = {"model": model, "messages": ollama_history, "tools": [CLOCK], "stream": False}
    r = http.post("/api/chat", json={**body, "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["prompt_eval_count"] > 0, r.text
    # bad calls and choices are 400s
    bad = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0] must be"),
        ({"tools": [WEATHER, "get_time"]}, "tools[1] must be"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "not valid JSON",
        ),
    ]
    for extra, words in bad:
        body = {"model": model, "messages": messages, "tools": [WEATHER], **extra}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert http.post("/api/generate", json={"model": model, "keep_alive": 0}).status_code == 200


def test_mistral_tool_calls(oai, http, files):
    """A Mistral template's calls: a required call comes back with an id its template
    takes back (9 characters); the call and its result go back through the template, and
    another id is the template's 400."""
    model, ask = str(files["mistral"]), [{"role": "user", "content": "Weather?"}]
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    r = oai.chat.completions.create(
        model=model, messages=ask, tools=[tool], tool_choice="required", max_tokens=100,
        temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.tool_calls, r
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and re.fullmatch("[0-9a-z]{9}", call.id)
    said = {"id": call.id, "type": "function", "function": call.function.model_dump()}
    history = ask + [
        {"role": "assistant", "content": None, "tool_calls": [said]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    body = {"model": model, "messages": history, "tools": [tool], "max_tokens": 2}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_1"
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "length 9" in r.text, r.text


def test_template_variables(oai, http, files):
    """ollama's think and OpenAI's chat_template_kwargs reach the template: false
    enable_thinking writes Qwen3's empty thought into the prompt; a variable that would
    replace one the template is given is a 400."""
    model, hi = str(files["tools"]), [{"role": "user", "content": "Hi"}]

    def ollama_prompt(**extra) -> int:
        body = {"model": model, "messages": hi, "stream": False, **extra}
        r = http.post("/api/chat", json={**body, "options": {"num_predict": 1}}).json()
        return r["prompt_eval_count"] + r["prompt_cache_count"]

    empty_thought = len("<think>\n\n</think>\n\n")  # one token a byte
    plain = ollama_prompt()
    assert ollama_prompt(think=True) == plain
    assert ollama_prompt(think=False) == plain + empty_thought
    r = oai.chat.completions.create(
        model=model, messages=hi, max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert r.usage.prompt_tokens == plain + empty_thought
    body = {"model": model, "messages": hi, "chat_template_kwargs": {"messages": []}}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "may not set messages" in r.text, r.text
    # OpenAI's reasoning effort: "none" answers at once, any other thinks first

    def prompt_tokens(path: str, **extra) -> int:
        if path == "/v1/responses":
            body = {"model": model, "input": "Hi", "max_output_tokens": 1, **extra}
            usage = http.post(path, json=body).json()["usage"]
            return usage["input_tokens"]
        body = {"model": model, "messages": hi, "max_tokens": 1, **extra}
        return http.post(path, json=body).json()["usage"]["prompt_tokens"]

    chat = "/v1/chat/completions"
    assert prompt_tokens(chat, reasoning_effort="none") == plain + empty_thought
    assert prompt_tokens(chat, reasoning_effort="high") == plain
    assert prompt_tokens("/v1/responses", reasoning={"effort": "none"}) == plain + empty_thought
    assert prompt_tokens("/v1/responses", reasoning={"effort": "low"}) == plain
    r = http.post(chat, json={"model": model, "messages": hi, "reasoning_effort": "max"})
    assert r.status_code == 400 and "reasoning_effort must be one of" in r.text


SEEDED = {"temperature": 1.0, "seed": 1}
THOUGHT_GBNF = 'root ::= "<think>\\n" "hm" "\\n</think>\\n\\n" "Hello"'


def test_thinking(http, files):
    """A thinking model's thoughts come apart from its answer: ollama's thinking,
    OpenAI's reasoning_content, streamed or not; reasoning_format "none" leaves them in
    the content; think: true on a model that cannot think is a 400."""
    model, hi = str(files["thinker"]), [{"role": "user", "content": "Hi"}]
    show = http.post("/api/show", json={"model": model}).json()
    assert "thinking" in show["capabilities"]
    assert "thinking" not in http.post("/api/show", json={"model": MODEL}).json()["capabilities"]
    r = http.post("/api/chat", json={"model": MODEL, "messages": hi, "think": True})
    assert r.status_code == 400 and r.json()["error"] == f"{MODEL} does not support thinking"

    def openai(stream: bool, n: int = 8, **extra) -> tuple[str, str]:
        body = {"model": model, "messages": hi, "max_tokens": n, **SEEDED, **extra}
        if not stream:
            m = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            return m.get("reasoning_content", ""), m["content"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        deltas = [
            json.loads(d)["choices"][0]["delta"] for d in data[:-1] if json.loads(d)["choices"]
        ]
        return tuple(
            "".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")
        )

    def ollama_chat(stream: bool, n: int = 8, **extra) -> tuple[str, str]:
        body = {"model": model, "messages": hi, "stream": stream, **extra}
        body["options"] = {"num_predict": n, **SEEDED}
        lines = (
            ollama(http, "/api/chat", body)
            if stream
            else [http.post("/api/chat", json=body).json()]
        )
        return tuple(
            "".join(x["message"].get(k, "") for x in lines) for k in ("thinking", "content")
        )

    # The prompt opened the thought: the 8 tokens are all thought (the tiny model never
    # writes </think>). Greedy, it writes 8 newlines: sampled, with a seed, some text.
    _, raw = openai(False, reasoning_format="none")
    assert raw.strip() and raw != raw.strip() and "</think>" not in raw  # space to drop, too
    for stream in (False, True):
        assert openai(stream) == (raw.strip(), "")
        assert ollama_chat(stream) == (raw.strip(), "")
    # A constrained answer is the grammar's from its first token, its thought closed
    # only where the grammar writes the tags: a JSON string that holds </think> is all
    # answer; a GBNF sentence that begins with a thought is split.
    schema = {"type": "string", "enum": ["</think>Hello"]}
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for stream in (False, True):
        assert openai(stream, 20, response_format=rf) == ("", '"</think>Hello"')
        assert ollama_chat(stream, 20, format=schema) == ("", '"</think>Hello"')
        assert openai(stream, 30, grammar=THOUGHT_GBNF) == ("hm", "Hello")
        assert ollama_chat(stream, 30, grammar=THOUGHT_GBNF) == ("hm", "Hello")
    # think: false writes the empty thought: nothing opens, all is the answer's text
    assert ollama_chat(False, think=False)[0] == ""
    # An earlier answer's thoughts, sent back, reach the template (ollama's thinking,
    # OpenAI's reasoning_content): it writes them, one token a byte here.
    said = {"role": "assistant", "content": "Hello"}
    again = [*hi, said, {"role": "user", "content": "More"}]

    def prompt_tokens(path: str, **thought) -> int:
        body = {"model": model, "messages": [*again[:1], {**said, **thought}, again[2]]}
        if path == "/api/chat":
            r = http.post(path, json={**body, "stream": False, "options": {"num_predict": 1}})
            return r.json()["prompt_eval_count"] + r.json()["prompt_cache_count"]
        return http.post(path, json={**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]

    written = len("<think>\nabc\n</think>\n\n")
    for path, key in (("/api/chat", "thinking"), ("/v1/chat/completions", "reasoning_content")):
        assert prompt_tokens(path, **{key: "abc"}) == prompt_tokens(path) + written, path


def test_embeddings(oai, http, files):
    """/api/embed, /api/embeddings and /v1/embeddings give the model's pooled states as
    computed in-process (ollama's first endpoint not at unit length); several inputs,
    token ids, base64, dimensions; bad input is a 400; an embedding made while answers
    stream is the same."""
    import base64
    import threading

    import torch

    from infer.runtime.embedding import embed
    from infer.runtime.loader import load_model
    from infer.runtime.session import Session

    model, texts = str(files["tools"]), ["The cat sat.", "A dog ran far away."]
    lm = load_model(files["tools"])
    ids = [lm.tokenizer.encode_embedded(t) for t in texts]
    want = [embed(Session(lm.model), i, "mean") for i in ids]
    raw = embed(Session(lm.model), ids[0], "mean", normalize=False)

    def close(a, b) -> bool:
        return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5

    r = http.post("/api/embed", json={"model": model, "input": texts}).json()
    assert all(map(close, r["embeddings"], want)) and r["prompt_eval_count"] == sum(map(len, ids))
    r = http.post("/api/embed", json={"model": model, "input": texts[0], "dimensions": 8}).json()
    short = torch.tensor(want[0][:8])
    assert close(r["embeddings"][0], (short / short.norm()).tolist())
    r = http.post("/api/embeddings", json={"model": model, "prompt": texts[0]}).json()
    assert close(r["embedding"], raw)
    e = oai.embeddings.create(model=model, input=texts)  # the openai package asks for base64
    assert [d.index for d in e.data] == [0, 1] and all(
        close(d.embedding, w) for d, w in zip(e.data, want)
    )
    assert e.usage.prompt_tokens == sum(map(len, ids))
    body = {"model": model, "input": ids[1], "encoding_format": "float"}
    assert close(http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"], want[1])
    body["encoding_format"] = "base64"
    packed = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    assert close(
        torch.frombuffer(bytearray(base64.b64decode(packed)), dtype=torch.float32).tolist(), want[1]
    )
    for path, body, words in (
        ("/v1/embeddings", {"model": model, "input": []}, "input must be"),
        ("/v1/embeddings", {"model": model, "input": [[10**9]]}, "past the vocabulary"),
        ("/v1/embeddings", {"model": model, "input": "x", "encoding_format": "hex"}, "encoding_format"),
        ("/api/embed", {"model": model, "input": [[1, 2]]}, "list of strings"),
        ("/api/embed", {"model": model, "input": "x " * 1500, "truncate": False}, "longer than the context"),
    ):  # fmt: skip
        r = http.post(path, json=body)
        assert r.status_code == 400 and words in r.text, (path, r.text)
    long = http.post("/api/embed", json={"model": model, "input": "x " * 1500}).json()
    assert long["prompt_eval_count"] == CTX  # cut to the context
    # While two answers stream (every slot of the main server busy), the embedding waits
    # for a slot and is the same.
    stop = threading.Event()

    def answer() -> None:
        body = {
            "model": MODEL,
            "messages": QUESTION,
            "stream": True,
            "options": {"num_predict": 40},
        }
        with http.stream("POST", "/api/chat", json=body) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=answer) for _ in range(2)]
    for t in threads:
        t.start()
    r = http.post("/api/embed", json={"model": model, "input": texts}).json()
    stop.set()
    for t in threads:
        t.join()
    assert all(map(close, r["embeddings"], want))

    def settled() -> bool:  # the answers left behind end (and are counted) before the next test
        m = metrics(http)
        return not any(v for k, v in m.items() if k.startswith("infer_answers_running"))

    wait_for(settled, what="the cancelled answers to end")


def test_llama_server_endpoints(oai, http, files, smollm2_gguf):
    """llama-server's /completion (text or token ids; streamed; stop types), /infill
    and /tokenize, /detokenize: the same answers as the OpenAI API's."""
    from infer.runtime.files.gguf import GGUFFile
    from infer.runtime.model.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(smollm2_gguf).metadata)
    prompt = "The capital of France is"
    want = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0}
    r = http.post("/completion", json=body).json()
    assert r["content"] == want.choices[0].text and r["stop"] is True
    assert (r["tokens_predicted"], r["stop_type"], r["model"]) == (8, "limit", MODEL)
    assert r["timings"]["predicted_n"] == 8 and r["tokens_evaluated"] == want.usage.prompt_tokens
    with http.stream("POST", "/completion", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == r["content"]
    ids = http.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
    assert ids == tok.encode(prompt)
    assert http.post("/completion", json={**body, "prompt": ids}).json()["content"] == r["content"]
    pieces = http.post("/tokenize", json={"content": "Hi there", "with_pieces": True}).json()
    assert "".join(t["piece"] for t in pieces["tokens"]) == "Hi there"
    back = http.post("/detokenize", json={"tokens": tok.encode("Hi there", add_special=False)})
    assert back.json() == {"content": "Hi there"}
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400
    word = r["content"].split()[1]
    stopped = http.post("/completion", json={**body, "stop": [word]}).json()
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    assert word not in stopped["content"]
    # /infill: prefix, suffix, FIM tokens, then what is typed of the middle (a byte a token)
    model, before, after, typed = str(files["tools"]), "def f(x):\n    ", "\n    return y\n", "y ="
    extra = [{"filename": "util.py", "text": "def g(): pass"}]  # no repository tokens: left out
    fim = {"model": model, "input_prefix": before, "input_suffix": after, "prompt": typed}
    r = http.post("/infill", json={**fim, "n_predict": 3, "input_extra": extra}).json()
    assert r["tokens_evaluated"] == 3 + len(before + after + typed), r
    r = http.post("/infill", json={**fim, "model": MODEL})
    assert r.status_code == 400 and "does not support insert" in r.text
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 2
    assert props["model_path"].endswith(".gguf") and "im_start" in props["chat_template"]


def test_responses_api(oai, http, greedy, files):
    """OpenAI's Responses API: the answer the chat API gives, as an output_text message,
    whole or streamed (its events in order); instructions as the system message; tool
    calls as function_call items, taken back as input items; a thinking model's thoughts
    as a reasoning item; text.format; what it cannot do is a 400."""
    import jsonschema

    q = QUESTION[0]["content"]
    r = oai.responses.create(model=MODEL, input=q, temperature=0, max_output_tokens=12)
    assert r.output_text == greedy(QUESTION, 12) and r.status == "completed"
    r = oai.responses.create(model=MODEL, input=q, temperature=0, max_output_tokens=3)
    assert r.output_text == greedy(QUESTION, 3) and r.usage.output_tokens == 3
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    system = "Answer in French."
    r = oai.responses.create(
        model=MODEL, input=q, instructions=system, temperature=0, max_output_tokens=6
    )
    assert r.output_text == greedy([{"role": "system", "content": system}, *QUESTION], 6)
    stream = oai.responses.create(
        model=MODEL, input=q, temperature=0, max_output_tokens=12, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == greedy(QUESTION, 12)
    # tools, on the tiny code model: a required call, then the call and its output back
    coder = str(files["tools"])
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
    tool = {"type": "function", "name": "get_weather", "parameters": city}
    r = oai.responses.create(
        model=coder,
        input="Weather?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=100,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    back = [
        {"role": "user", "content": "Weather?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    r = oai.responses.create(model=coder, input=back, tools=[tool], max_output_tokens=2)
    assert r.usage.input_tokens > 0
    # a thinking model: its thoughts as a reasoning item, before the (empty) message
    thinker, hi = str(files["thinker"]), [{"role": "user", "content": "Hi"}]
    body = {"model": thinker, "messages": hi, "max_tokens": 8, **SEEDED}
    want = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    body = {"model": thinker, "input": "Hi", "max_output_tokens": 8, **SEEDED}
    r = http.post("/v1/responses", json=body).json()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"], json.dumps(r["output"])
    assert r["output"][0]["content"][0]["text"] == want["reasoning_content"] != ""
    assert r["output"][1]["content"][0]["text"] == ""
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as stream:
        events = [json.loads(x[6:]) for x in stream.iter_lines() if x.startswith("data: ")]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == want["reasoning_content"]
    done = events[-1]["response"]["output"]
    assert [(o["type"], o["content"]) for o in done] == [
        (o["type"], o["content"]) for o in r["output"]
    ]
    # text.format: a JSON schema
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    r = oai.responses.create(model=MODEL, input=ASK[0]["content"], text=fmt, temperature=0)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    for extra, words in (
        ({"previous_response_id": "resp_1"}, "not supported"),
        ({"tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": [{"type": "image", "url": "x"}]}, "not supported"),
        ({"input": []}, "input must be"),
    ):
        r = http.post("/v1/responses", json={"model": MODEL, "input": q, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_anthropic_messages(server, http, greedy, files):
    """Anthropic's Messages API through its own client: the answer the chat API gives,
    whole or streamed, with its stop reasons; tool_use blocks, taken back with their
    tool_result; a thinking model's thinking block and switch; count_tokens; its errors'
    shape."""
    import anthropic

    GREEDY = {"temperature": 0}  # the client sends no sampling settings of its own

    client = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT
    )
    q = [{"role": "user", "content": QUESTION[0]["content"]}]
    r = client.messages.create(model=MODEL, max_tokens=12, messages=q, extra_body=GREEDY)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == greedy(QUESTION, 12)
    assert r.stop_reason == "end_turn"
    r = client.messages.create(model=MODEL, max_tokens=3, messages=q, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    word = greedy(QUESTION, 12).split()[2]
    r = client.messages.create(
        model=MODEL, max_tokens=12, messages=q, extra_body=GREEDY, stop_sequences=[word]
    )
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", word)
    system = "Answer in French."
    r = client.messages.create(
        model=MODEL, max_tokens=6, messages=q, system=system, extra_body=GREEDY
    )
    assert r.content[0].text == greedy([{"role": "system", "content": system}, *QUESTION], 6)
    count = client.messages.count_tokens(model=MODEL, messages=q, system=system).input_tokens
    assert count == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=q, extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == greedy(QUESTION, 12)
    assert final.stop_reason == "end_turn"
    # tools, on the tiny code model: a call, then the call and its result taken back
    coder = str(files["tools"])
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}}
    tools = [{"name": "get_weather", "description": "The weather", "input_schema": city}]
    ask = [{"role": "user", "content": "Weather?"}]
    for any_stream in (False, True):
        kwargs = {"model": coder, "max_tokens": 100, "messages": ask, "tools": tools}
        kwargs.update(tool_choice={"type": "any"}, extra_body=GREEDY)
        if any_stream:
            with client.messages.stream(**kwargs) as stream:
                r = stream.get_final_message()
        else:
            r = client.messages.create(**kwargs)
        (use,) = [b for b in r.content if b.type == "tool_use"]
        assert (
            r.stop_reason == "tool_use"
            and use.name == "get_weather"
            and isinstance(use.input, dict)
        )
    back = ask + [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}],
        },
    ]
    r = client.messages.create(model=coder, max_tokens=2, messages=back, tools=tools)
    prompt = r.usage.input_tokens + r.usage.cache_read_input_tokens
    assert prompt > count_tokens_of(client, coder, ask, tools) + len("18 C")
    # a thinking model: its thoughts as a thinking block; thinking disabled: Qwen3's switch
    thinker, hi = str(files["thinker"]), [{"role": "user", "content": "Hi"}]
    body = {"model": thinker, "messages": hi, "max_tokens": 8, **SEEDED}
    want = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    r = client.messages.create(model=thinker, max_tokens=8, messages=hi, extra_body=SEEDED)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == want["reasoning_content"] != ""
    with client.messages.stream(
        model=thinker, max_tokens=8, messages=hi, extra_body=SEEDED
    ) as stream:
        assert stream.get_final_message().content[0].thinking == want["reasoning_content"]
    off = count_tokens_of(client, thinker, hi, None, thinking={"type": "disabled"})
    assert off == count_tokens_of(client, thinker, hi, None) + len("\n</think>\n\n")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert "not supported" in err.value.body["error"]["message"]
    r = http.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 2,
            "messages": q,
            "tools": [{"type": "web_search_20250305", "name": "w"}],
        },
    )
    assert (
        r.status_code == 400
        and r.json()["type"] == "error"
        and r.json()["error"]["type"] == "invalid_request_error"
    )


def count_tokens_of(client, model, messages, tools, **extra) -> int:
    kwargs = {"tools": tools} if tools else {}
    return client.messages.count_tokens(
        model=model, messages=messages, **kwargs, **extra
    ).input_tokens


def test_fill_in_the_middle(oai, http, files):
    """`suffix` (ollama's generate, OpenAI's completions): the prompt is the model's
    fill-in-the-middle layout, FIM prefix, code before, FIM suffix, code after, FIM
    middle (one token a byte here); a model without those tokens is a 400."""
    model, before, after = str(files["tools"]), "def f(x):\n    ", "\n    return y\n"
    body = {"model": model, "prompt": before, "suffix": after, "stream": False}

    def prompt(r: httpx.Response) -> int:  # computed or found in the prefix cache
        assert r.status_code == 200, r.text
        return r.json()["prompt_eval_count"] + r.json()["prompt_cache_count"]

    r = http.post("/api/generate", json={**body, "options": {"num_predict": 3}})
    assert prompt(r) == 3 + len(before + after)
    c = oai.completions.create(model=model, prompt=before, suffix=after, max_tokens=3)
    assert c.usage.prompt_tokens == 3 + len(before + after)
    r = http.post("/api/generate", json={**body, "model": MODEL})
    assert r.status_code == 400 and r.json()["error"] == f"{MODEL} does not support insert"
    r = http.post(
        "/api/generate", json={**body, "suffix": "", "raw": True, "options": {"num_predict": 1}}
    )
    assert prompt(r) == len(before)  # "": none
    assert http.post("/api/generate", json={"model": model, "keep_alive": 0}).status_code == 200


def test_pull_and_delete(http, home, smollm2_gguf):
    """/api/pull runs `infer pull` and streams its lines, ending in success (the default
    model is in the cache: nothing to fetch) or the error; /api/delete removes a model
    from the cache, and /api/tags no longer lists it."""
    lines = ollama_lines(http, "/api/pull", {"model": MODEL})
    assert lines[0] == {"status": f"pulling {MODEL}"} and lines[-1] == {"status": "success"}
    r = http.post("/api/pull", json={"model": MODEL, "stream": False})
    assert r.json() == {"status": "success"}
    lines = ollama_lines(http, "/api/pull", {"model": "no-such-model"})
    assert lines[-1] == {"error": "unknown model 'no-such-model' (see `infer list`)"}
    assert not any("error" in x.get("status", "") for x in lines)  # said once
    r = http.post("/api/pull", json={"model": "no-such-model", "stream": False})
    assert r.status_code == 400 and "unknown model" in r.json()["error"]
    assert http.post("/api/pull", json={}).status_code == 400
    # a second model in the cache (the same file), deleted
    folder = home / "models" / "smollm2-360m"
    _same_file(smollm2_gguf, folder / "SmolLM2-360M-Instruct.Q8_0.gguf")

    def names() -> list[str]:
        return [m["name"] for m in http.get("/api/tags").json()["models"]]

    assert "smollm2-360m" in names()
    assert http.request("DELETE", "/api/delete", json={"model": "smollm2-360m"}).status_code == 200
    assert "smollm2-360m" not in names() and not folder.exists() and MODEL in names()
    r = http.request("DELETE", "/api/delete", json={"model": "smollm2-360m"})
    assert r.status_code == 404 and "not on disk" in r.json()["error"]


def ollama_lines(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return ndjson(r)


def test_pull_status_lines():
    """Progress lines as ollama's status objects: bars' glyphs gone, bytes read off."""
    from infer.cli.server.ollama_models import _status

    joined = _status("joining part 1/4 \u2501\u2501\u2578    64.0/253.1 MB 218.6 MB/s")
    assert joined == {
        "status": "joining part 1/4 64.0/253.1 MB 218.6 MB/s",
        "completed": 64_000_000,
        "total": 253_100_000,
    }
    hub = _status("model.safetensors:  45%|####5     | 1.13G/2.50G [00:10<00:12, 110MB/s]")
    assert (hub["completed"], hub["total"]) == (1_130_000_000, 2_500_000_000)
    assert _status("fetching x from PyPI") == {"status": "fetching x from PyPI"}
    assert _status("Looking in links: /opt/wheels") is None


def test_keep_alive_zero_unloads(http):
    def loaded() -> list[str]:
        return [m["name"] for m in http.get("/api/ps").json()["models"]]

    assert generates(http) and MODEL in loaded()
    r = http.post("/api/generate", json={"model": MODEL, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done"] is True
    assert MODEL not in loaded()
    assert metrics(http)["infer_models_loaded"] == len(loaded())
    # An answer's own keep_alive 0: loaded for it, kept while it runs (a counting
    # that goes on for more than the keep-alive check's period), unloaded once done.
    body = {"prompt": "1, 2, 3, 4, 5,", "raw": True, "stream": False, "keep_alive": 0}
    r = http.post("/api/generate", json={**body, "options": {"num_predict": 40, "temperature": 0}})
    assert r.status_code == 200 and r.json()["eval_count"] == 40, r.text
    wait_for(lambda: MODEL not in loaded(), what="the unload")
    assert generates(http) and MODEL in loaded()  # and loaded again on use


# -- a server with an API key, stopped mid-answer ---------------------------------------


def test_draft_model_answers_as_plain(launched, greedy):
    """serve --draft: the slot's draft model guesses (here perfectly, being the model
    itself), and the answer is the plain greedy one."""
    s = launched["keyed"].ready()
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=s.url, timeout=TIMEOUT, headers=auth) as http:
        body = {"messages": QUESTION, "max_tokens": 24, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy(QUESTION, 24)
        m = metrics(http)
    guessed = m[f'infer_speculative_guessed_tokens_total{{model="{MODEL}"}}']
    assert m[f'infer_speculative_accepted_tokens_total{{model="{MODEL}"}}'] == guessed > 0


def test_int8_kv_cache_on_parallel_slots(launched, smollm2_gguf):
    """serve --kv-cache int8 --parallel 2: two answers run together on int8 slots, each
    the greedy answer of an int8 cache in this process, and /api/ps counts the two slots'
    caches at int8's size."""
    import torch

    from infer.runtime.answer import stream_answer
    from infer.runtime.generate import make_sampler
    from infer.runtime.loader import kv_cache_bytes, load_model
    from infer.runtime.session import Session

    s = launched["int8"].ready()
    lm = load_model(smollm2_gguf, max_seq_len=CTX, kv_cache="int8")
    count = [{"role": "user", "content": "Count from 1 to 50, one number per line."}]
    asks = [(count, 120), (QUESTION, 16)]

    def alone(messages: list[dict], n: int) -> str:
        ids, sampler = lm.tokenizer.encode_chat(messages), make_sampler(0)
        session = Session(lm.model, CTX)  # int8: the loader's kv_cache
        return stream_answer(session, lm.tokenizer, ids, sampler, n, lambda _: None).text

    def piece(line: str) -> str:
        return json.loads(line)["message"]["content"]

    running = f'infer_answers_running{{model="{MODEL}"}}'
    bodies = [{"messages": m, "options": {"num_predict": n, "temperature": 0}} for m, n in asks]
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        with (
            http.stream("POST", "/api/chat", json=bodies[0]) as first,
            http.stream("POST", "/api/chat", json=bodies[1]) as second,
        ):
            lines = [first.iter_lines(), second.iter_lines()]
            texts = [piece(next(lines[0])), piece(next(lines[1]))]
            assert metrics(http)[running] == 2
            texts = [t + "".join(piece(x) for x in it if x) for t, it in zip(texts, lines)]
        ps = http.get("/api/ps").json()["models"]
        kept = metrics(http)[f'infer_prompt_cache_bytes{{model="{MODEL}"}}']
    assert texts == [alone(m, n) for m, n in asks]
    caches = 2 * kv_cache_bytes(lm.model.args, torch.float32, CTX, "int8")
    assert ps[0]["size"] == lm.source.held_bytes(torch.float32) + caches + kept
    float_caches = 2 * kv_cache_bytes(lm.model.args, torch.float32, CTX)
    assert float_caches / caches == pytest.approx(4 * 32 / 34)  # 34 bytes per 32 values
    code, _ = s.stop()
    assert code == 0 and "Traceback" not in s.log.read_text()


def test_api_key_and_sigterm_mid_stream(launched):
    s = launched["keyed"].ready()
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = http.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["message"]
            r = http.post("/api/generate", headers=headers, json={"prompt": "Hi"})
            assert r.status_code == 401 and isinstance(r.json()["error"], str)
        assert http.get("/health").status_code == 200  # for load balancers, no key
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert r.usage.completion_tokens == 2
        # Anthropic's clients send the key as x-api-key
        body = {"messages": HI, "max_tokens": 2}
        assert http.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        r = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            wrong = openai.OpenAI(
                base_url=s.url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0
            )
            wrong.models.list()

        # SIGTERM with one answer streaming and one queued behind it: both end
        # cleanly (the last chunk and [DONE]; a last line done, or an error if the
        # queued one came in after the signal), and the server exits 0.
        auth = {"Authorization": f"Bearer {KEY}"}
        story = [{"role": "user", "content": "Tell a long story."}]
        body = {"messages": story, "max_tokens": 400, "stream": True}
        with (
            http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as sse,
            http.stream("POST", "/api/chat", json={"messages": story}, headers=auth) as queued,
        ):
            events = sse.iter_lines()
            assert sse.status_code == 200 and next(events).startswith("data: ")
            assert queued.status_code == 200
            code, took = s.stop()
            rest = [line for line in events if line]
            lines = ndjson(queued)
        assert code == 0 and took < 10, s.log.read_text()
        assert rest[-1] == "data: [DONE]" and len(rest) < 300
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
        assert lines[-1].get("done") is True or "stopping" in lines[-1]["error"], lines[-1]
        assert len(lines) < 300
    assert "Traceback" not in s.log.read_text()


# -- structured output ------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a made-up person as JSON: name, age, tags."}]


def test_openai_json_schema_and_json_object(oai):
    import jsonschema

    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0.7, seed=3, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    short = "Reply in JSON: an object whose one key, capital, holds the capital of France."
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": short}], temperature=0,
        max_tokens=200, response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_ollama_format(http):
    import jsonschema

    lines = ollama(
        http, "/api/chat",
        {"model": MODEL, "messages": ASK, "format": PERSON, "options": {"temperature": 0}},
    )  # fmt: skip
    text = "".join(line["message"]["content"] for line in lines)
    assert lines[-1]["done_reason"] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/api/generate", {"prompt": "x", "format": {"type": "nonsense"}}, "format"),
        ("/api/generate", {"prompt": "x", "format": "yaml"}, "format"),
        (
            "/v1/chat/completions",
            {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": QUESTION,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "minProperties": "two"}},
                },
            },
            "response_format",
        ),
    ],
)
def test_invalid_format_is_a_400(http, path, body, field):
    r = _post(http, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert field in message
    assert generates(http)


# -- infer run as the client ------------------------------------------------------------


def run_client(server, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`infer run ARGS` with INFER_HOST naming the server."""
    base = {k: v for k, v in os.environ.items() if k not in ("INFER_DEBUG", "INFER_API_KEY")}
    host = server.url.removeprefix("http://")
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", "run", *map(str, args)],
        check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
        env={**base, "HF_HUB_OFFLINE": "1", "INFER_HOST": host, **(env or {})},
    )  # fmt: skip


def test_run_asks_the_server(server, http, greedy, home):
    before = _answers(metrics(http))
    r = run_client(server, MODEL, QUESTION[0]["content"], "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy(QUESTION, 12) + "\n" and r.stderr == ""
    assert _answers(metrics(http)) == before + 1  # the server answered, not this process

    r = run_client(server, MODEL, QUESTION[0]["content"], "-n", "12", "--temp", "0", "--json")
    data = json.loads(r.stdout)
    assert data["text"] == greedy(QUESTION, 12) and data["prompt_tokens"] > 0
    assert data["timings"]["load_s"] < 1  # nothing was loaded for it
    assert _answers(metrics(http)) == before + 2


def test_run_local_and_unserved_files_stay_in_process(server, http, greedy, files):
    before = _answers(metrics(http))
    for args in (
        [MODEL, "--local"],
        [files["outside"]],  # a file the server may not read: loaded here
    ):
        r = run_client(
            server, *args, QUESTION[0]["content"], "-n", "12", "--temp", "0", "--ctx", CTX
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == greedy(QUESTION, 12) + "\n"
    assert _answers(metrics(http)) == before


def test_run_client_errors(server):
    r = run_client(server, "no-such-model", "Hi")
    assert r.returncode == 2 and r.stderr.startswith("error: unknown model 'no-such-model'")
    r = run_client(server, MODEL, "Hi " * 600, "-n", "4")  # longer than the server's context
    assert r.returncode == 2 and "longer than the context" in r.stderr, r.stderr


def test_run_format_through_the_server(server, http, tmp_path):
    import jsonschema

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    before = _answers(metrics(http))
    r = run_client(server, MODEL, ASK[0]["content"], "--format", schema, "--temp", "0")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), PERSON)
    assert _answers(metrics(http)) == before + 1


DATE_GBNF = r"""
root ::= date " " mood
date ::= [0-9]{4} "-" [01] [0-9] "-" [0-3] [0-9]
mood ::= "calm" | "busy" | "stormy"
"""
DATE = re.compile(r"[0-9]{4}-[01][0-9]-[0-3][0-9] (calm|busy|stormy)")


def test_gbnf_grammar(http):
    """llama-server's `grammar` (GBNF) in both APIs: the answer is a sentence of it; with
    a format it is a 400, and so is a grammar that does not parse."""
    ask = [{"role": "user", "content": "Today's date and mood?"}]
    body = {"model": MODEL, "messages": ask, "grammar": DATE_GBNF, "temperature": 0}
    r = http.post("/v1/chat/completions", json=body).json()
    assert DATE.fullmatch(r["choices"][0]["message"]["content"]), r
    r = http.post("/v1/completions", json={**body, "prompt": "Date:", "max_tokens": 30}).json()
    assert DATE.fullmatch(r["choices"][0]["text"]), r
    r = http.post("/api/chat", json={**body, "stream": False}).json()
    assert DATE.fullmatch(r["message"]["content"]), r
    for path, extra, words in (
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "not both"),
        ("/api/chat", {"format": "json"}, "not both"),
        ("/v1/chat/completions", {"grammar": "root ::= nothing"}, "grammar: invalid grammar"),
    ):
        r = http.post(path, json={**body, **extra})
        assert r.status_code == 400 and words in r.text, (path, r.text)


def test_run_grammar_file(server, http, tmp_path):
    """`infer run --grammar-file`: through the server and in-process alike."""
    grammar = tmp_path / "date.gbnf"
    grammar.write_text(DATE_GBNF)
    for where in ([], ["--local"]):
        r = run_client(server, MODEL, "Date?", "--grammar-file", grammar, "--temp", "0", *where)
        assert r.returncode == 0 and DATE.fullmatch(r.stdout.strip()), (where, r.stdout, r.stderr)
    r = run_client(server, MODEL, "Date?", "--grammar-file", grammar, "--format", "json")
    assert r.returncode == 2 and "not both" in r.stderr
    r = run_client(server, MODEL, "Date?", "--grammar-file", tmp_path / "none.gbnf")
    assert r.returncode == 2 and r.stderr.startswith("error: --grammar-file"), r.stderr


def test_chat_through_the_server(server, http, greedy, monkeypatch):
    from test_cli import Terminal

    monkeypatch.setenv("INFER_HOST", server.url.removeprefix("http://"))
    before = _answers(metrics(http))
    with Terminal("run", MODEL, "--temp", "0", "-n", "12") as term:
        term.read_until(">>> ", 0)
        out = term.read_until(">>> ", term.send(QUESTION[0]["content"] + "\n"))
        assert greedy(QUESTION, 12) in out.replace("\r\n", "\n")
        out = term.read_until(">>> ", term.send("/show info\n"))
        assert "server" in out and "Q4_1" in out
        term.send("/bye\n")
        assert term.proc.wait(30) == 0
    assert _answers(metrics(http)) == before + 1


def test_run_shows_thoughts_apart(server, http, files, monkeypatch, tmp_path):
    """A thinking model in `infer run`, through the server and in-process alike: --json
    gives the thoughts apart from the text, a pipe gets the answer alone, a terminal
    shows the thoughts dimmed before it."""
    from test_cli import Terminal

    grammar = tmp_path / "thought.gbnf"  # the answer: a thought "hm", then "Hello"
    grammar.write_text(THOUGHT_GBNF)
    ask = [files["thinker"], "Hi", "--grammar-file", grammar, "--temp", "0", "-n", "30"]
    for where in ([], ["--local"]):
        r = run_client(server, *ask, "--json", *where)
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert (data["thinking"], data["text"]) == ("hm", "Hello"), where
        r = run_client(server, *ask, *where)
        assert r.returncode == 0 and r.stdout == "Hello\n", (where, r.stdout, r.stderr)
    monkeypatch.setenv("INFER_HOST", server.url.removeprefix("http://"))
    with Terminal("run", *ask) as term:
        out = term.read_until("Hello", 0).replace("\r\n", "\n")
        assert "\x1b[2mThinking...\nhm\n...done thinking.\n\n\x1b[0mHello" in out, out
        assert term.proc.wait(30) == 0
    # the chat, through the server: a sampled thought of 8 tokens, cut unclosed, is shown
    # dimmed and closed, and the next prompt comes
    chat = [files["thinker"], "--temp", "1", "--seed", "1", "-n", "8"]
    with Terminal("run", *chat) as term:
        term.read_until(">>> ", 0)
        out = term.read_until(">>> ", term.send("Hi\n")).replace("\r\n", "\n")
        assert "\x1b[2mThinking...\n" in out and "\n...done thinking.\n\n\x1b[0m" in out, out
        term.send("/bye\n")
        assert term.proc.wait(30) == 0


def test_embed_asks_the_server(server, http, smollm2_gguf):
    """`infer embed` through a running server: the server computes the vectors (its
    /api/embed count moves), the same as in-process."""
    key = 'infer_requests_total{path="/api/embed",status="200"}'
    before = metrics(http).get(key, 0)
    base = {k: v for k, v in os.environ.items() if k not in ("INFER_DEBUG", "INFER_API_KEY")}
    env = {**base, "HF_HUB_OFFLINE": "1", "INFER_HOST": server.url.removeprefix("http://")}

    def embed(*args) -> list[list[float]]:
        r = subprocess.run(
            [sys.executable, "-m", "infer.cli.main", "embed", MODEL, "a cat", "a dog", *args],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        return [json.loads(line) for line in r.stdout.splitlines()]

    served, here = embed(), embed("--local")
    assert metrics(http)[key] == before + 1
    assert all(max(abs(x - y) for x, y in zip(a, b)) < 1e-5 for a, b in zip(served, here))


def test_ps_and_stop(server, http, files):
    """`infer ps` lists what the server holds; `infer stop MODEL` unloads it; a model not
    loaded, or no server, is an error (exit 1)."""
    base = {k: v for k, v in os.environ.items() if k not in ("INFER_DEBUG", "INFER_API_KEY")}
    env = {**base, "INFER_HOST": server.url.removeprefix("http://")}

    def infer(*args, host_env=env) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "infer.cli.main", *map(str, args)],
            capture_output=True, text=True, env=host_env, timeout=120, check=False,
        )  # fmt: skip

    coder = str(files["tools"])
    body = {
        "model": coder,
        "prompt": "x",
        "raw": True,
        "stream": False,
        "options": {"num_predict": 1},
    }
    assert http.post("/api/generate", json=body).status_code == 200  # loaded
    listed = json.loads(infer("ps", "--json").stdout)
    assert coder in [m["name"] for m in listed]
    r = infer("ps")
    assert r.returncode == 0 and r.stdout.splitlines()[0].split() == [
        "NAME",
        "SIZE",
        "CONTEXT",
        "UNTIL",
    ]
    assert infer("stop", coder).returncode == 0
    assert coder not in [m["name"] for m in http.get("/api/ps").json()["models"]]
    r = infer("stop", coder)
    assert r.returncode == 1 and "is not loaded" in r.stderr
    r = infer("ps", host_env={**base, "INFER_HOST": "127.0.0.1:9"})
    assert r.returncode == 1 and r.stderr.startswith("error: no server at 127.0.0.1:9")
