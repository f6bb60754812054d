"""End to end: `kylin serve` with SmolLM2-135M-Instruct, driven by the official `openai` client.

The suite starts the server itself on a free 127.0.0.1 port (KYLIN_BIN, default
target/release/kylin; the model from KYLIN_MODELS), waits for /health, and stops it with
SIGTERM at the end (it must exit 0). Nothing leaves the loopback interface; every loop is
bounded.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import http.client as httpclient
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache" / "kylin-models"))
MODEL = MODELS / "smollm2-135m-instruct"
KEY = "test-key"
NAME = "smollm2"
MAX_QUEUE = 16


def kylin_bin():
    explicit = os.environ.get("KYLIN_BIN")
    if explicit:
        return explicit
    target = os.environ.get("CARGO_TARGET_DIR", ROOT / "target")
    return str(Path(target) / "release" / "kylin")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(base, method, path, body=None, key=KEY, timeout=30):
    """One plain HTTP request (the standard library's client): (status, headers, text)."""
    host, port = base.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


class Server:
    def __init__(self, *extra, model=MODEL, ctx=2048):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"kylin-e2e-{self.port}.log", "w")
        args = [kylin_bin(), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", NAME, "--api-key", KEY, "--max-queue", str(MAX_QUEUE),
                "--max-body-bytes", "65536", "--ctx-size", str(ctx), *extra]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.kill()
            raise

    def wait_ready(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kylin serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if http(self.base, "GET", "/health", key=None, timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError("kylin serve was not ready within 120 s")

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)

    def metrics(self):
        text = http(self.base, "GET", "/metrics")[2]
        values = {}
        for line in text.splitlines():
            if line.startswith("kylin:") and "{" in line:
                name = line.split("{", 1)[0]
                labels = line.split("{", 1)[1].rsplit("}", 1)[0]
                if "le=" not in labels and "finished_reason" not in labels:
                    values[name] = float(line.rsplit(" ", 1)[1])
        return values

    def rss_kib(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self, timeout=60):
        """SIGTERM; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def stream_lines(base, path, body, timeout=60):
    """Posts `body` and yields the response's lines as they arrive; closing the generator
    closes the connection (a client that goes away)."""
    host, port = base.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        while True:
            line = r.fp.readline()
            if not line:
                return
            yield line.decode().rstrip("\r\n")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server():
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL} is missing; run scripts/setup.sh")
    s = Server()
    try:
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"kylin serve did not exit cleanly on SIGTERM (code {code})"


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, text, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], **kw)


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert http(server.base, "GET", "/health", key=None)[0] == 200


def test_chat_completion(client):
    r = chat(client, "What is the capital of France?", max_tokens=32)
    assert r.object == "chat.completion"
    assert r.model == NAME
    assert r.choices[0].message.role == "assistant"
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5
    assert r.usage.completion_tokens >= 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_with_text_and_token_prompts(client):
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert "Paris" in r.choices[0].text
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ids = json.loads(http(base, "POST", "/tokenize", {"prompt": "The capital of France is"})[2])["tokens"]
    assert json.loads(http(base, "POST", "/detokenize", {"tokens": ids})[2])["prompt"] == "The capital of France is"
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_streaming_with_usage_equals_the_whole_answer(client):
    whole = chat(client, "Name three colors.", max_tokens=40)
    stream = chat(client, "Name three colors.", max_tokens=40, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_is_never_emitted(client):
    full = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=40, temperature=0).choices[0].text
    words = full.split()
    assert len(words) > 6, full
    stop = words[4]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop, stream=True))
    assert streamed == cut


def test_n_and_seeds(client):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, n=2)
    a = chat(client, "Write a short poem about the sea.", **kw)
    b = chat(client, "Write a short poem about the sea.", **kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    c = chat(client, "Write a short poem about the sea.", **{**kw, "seed": 99})
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


def test_logprobs(client):
    r = chat(client, "Say hello.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
    c = client.completions.create(model=NAME, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) == 2 for t in lp.top_logprobs)


@pytest.fixture(scope="module")
def f32_client():
    """A server computing in float32, for comparisons with transformers' float32 references (the
    default precision, auto, is BF16 where the CPU has BF16 kernels)."""
    s = Server("--precision", "f32")
    try:
        yield s.client()
    finally:
        assert s.stop() == 0


def test_echo_scores_the_prompt_as_transformers_does(f32_client):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0 (and more)."""
    client = f32_client
    ref = json.loads((ROOT / "tests/fixtures/prompt_logprobs/smollm2-135m-instruct.json").read_text())
    want = [p["logprob"] for p in ref["positions"]]
    n_prompt = len(ref["input_ids"])
    c = client.completions.create(model=NAME, prompt=ref["prompt"], echo=True, logprobs=5, max_tokens=0)
    choice = c.choices[0]
    assert choice.text == ref["prompt"]
    assert choice.finish_reason == "length"
    assert c.usage.prompt_tokens == n_prompt and c.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    worst = max(abs(g - w) for g, w in zip(lp.token_logprobs[1:], want))
    assert worst < 1e-3, worst
    for i, top in enumerate(lp.top_logprobs[1:]):
        # The five best and the prompt's own token when it is not among them.
        assert 5 <= len(top) <= 6
        assert lp.tokens[i + 1] in top
    assert lp.text_offset == sorted(lp.text_offset)

    # Generating after the echo: the prompt's entries, then the generated tokens'.
    g = client.completions.create(model=NAME, prompt=ref["prompt"], echo=True, logprobs=1, max_tokens=5,
                                  temperature=0)
    assert g.choices[0].text.startswith(ref["prompt"])
    glp = g.choices[0].logprobs
    assert len(glp.tokens) == n_prompt + g.usage.completion_tokens
    assert max(abs(a - b) for a, b in zip(glp.token_logprobs[1:n_prompt], want)) < 1e-3
    plain = client.completions.create(model=NAME, prompt=ref["prompt"], max_tokens=5, temperature=0)
    assert g.choices[0].text == ref["prompt"] + plain.choices[0].text

    # Streamed: the prompt and its scores come first, in one chunk.
    chunks = list(client.completions.create(model=NAME, prompt=ref["prompt"], echo=True, logprobs=5,
                                            max_tokens=5, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == ref["prompt"]
    assert max(abs(a - b) for a, b in zip(first.logprobs.token_logprobs[1:], want)) < 1e-3
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref["prompt"] + plain.choices[0].text


def test_chat_template_kwargs_and_text_parts(client):
    r = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                {"type": "text", "text": " of France?"}]}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert "Paris" in r.choices[0].message.content


def test_400_with_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], tool_choice="g")
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi " * 3000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
    assert "2048" in e.value.body["message"]
    # The engine's own checks name the parameter they refuse, not the prompt.
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=4000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", n=100)
    assert e.value.body["param"] == "n" and "--max-seqs" in e.value.body["message"], e.value.body


def test_401_404_413(server, client):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    status, _, text = http(server.base, "POST", "/v1/no/such/route", {})
    assert status == 404 and "error" in json.loads(text)
    status, _, text = http(server.base, "POST", "/v1/completions", {"model": NAME, "prompt": "x" * 100_000})
    assert status == 413 and json.loads(text)["error"]["code"] == "body_too_large"
    # /health stays public; everything else needs the key.
    assert http(server.base, "GET", "/metrics", key=None)[0] == 401


def test_disconnect_mid_stream_frees_the_sequence(server):
    body = {"model": NAME, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines = stream_lines(server.base, "/v1/completions", body)
    received = 0
    for line in lines:
        received += line.startswith("data: ")
        if received >= 3:
            break
    lines.close()
    # The connection is closed: within a few engine steps nothing runs and every block is free.
    deadline = time.time() + 15
    m = server.metrics()
    while time.time() < deadline and (m["kylin:num_requests_running"] or m["kylin:kv_cache_blocks_used"]):
        time.sleep(0.05)
        m = server.metrics()
    assert m["kylin:num_requests_running"] == 0
    assert m["kylin:num_requests_waiting"] == 0
    assert m["kylin:kv_cache_blocks_used"] == 0
    assert m["kylin:generation_tokens_total"] > 0


def test_16_concurrent_greedy_requests_equal_each_alone(client):
    prompts = [f"Tell me one fact about the number {i}." for i in range(16)]
    alone = [chat(client, p, max_tokens=12).choices[0].message.content for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: chat(client, p, max_tokens=12).choices[0].message.content, prompts))
    assert together == alone


def test_overload_gets_429_for_the_excess_and_full_answers_for_the_rest(server):
    # Warm up, then measure memory before the storm.
    client = server.client()
    chat(client, "hi", max_tokens=4)
    rss_before = server.rss_kib()
    total = 4 * MAX_QUEUE

    def one(i):
        try:
            r = chat(client, f"Say the number {i}.", max_tokens=8)
            return ("ok", r.choices[0].finish_reason, r.usage.completion_tokens)
        except openai.RateLimitError as e:
            return ("429", e.response.headers.get("retry-after"), None)

    with concurrent.futures.ThreadPoolExecutor(total) as pool:
        results = list(pool.map(one, range(total)))
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    assert len(ok) + len(refused) == total
    assert refused, "no request was refused"
    assert all(r[1] == "1" for r in refused)
    assert len(ok) >= MAX_QUEUE
    assert all(r[1] in ("stop", "length") and r[2] >= 1 for r in ok)
    m = server.metrics()
    assert m["kylin:num_requests_running"] == 0 and m["kylin:kv_cache_blocks_used"] == 0
    assert m["kylin:request_rejected_queue_full_total"] >= len(refused)
    rss_after = server.rss_kib()
    assert rss_after <= rss_before * 1.05, (rss_before, rss_after)


def test_sigterm_lets_a_running_request_finish():
    s = Server()
    try:
        body = {"model": NAME, "prompt": "Count:", "max_tokens": 48, "ignore_eos": True, "stream": True}
        events = []
        for line in stream_lines(s.base, "/v1/completions", body):
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 2:
                s.proc.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                # Not ready any more: no new connections are accepted (or 503 on a kept one).
                try:
                    assert http(s.base, "GET", "/health", key=None, timeout=2)[0] == 503
                except OSError:
                    pass
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(timeout=60) == 0
    finally:
        s.kill()
