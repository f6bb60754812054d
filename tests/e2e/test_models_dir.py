"""End to end: many models behind one `kylin serve` (--models-dir and --models), with the
official `openai` client on loopback.

Two models are served from one endpoint: SmolLM2-135M-Instruct (about 257 MiB of weights) and
the tiny Qwen3 fixture (about 9 MiB), each with a 16 MiB KV cache, under a memory budget that
holds one of them at a time (290 MiB). So a request for one loads it on demand and unloads the
other, the least recently used; a pinned model is never unloaded for room; a model serving a
stream refuses to be unloaded; a request for a model that is loading waits for it.
"""

import concurrent.futures
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_balancer import wait_ready
from test_retrieval import MODELS, ROOT, free_port, kylin_bin

SMOL = MODELS / "smollm2-135m-instruct"
TINY = ROOT / "testdata/fixtures/tiny-qwen3"
COMMON = ["--host", "127.0.0.1", "--threads", "1", "--kv-memory", "16MiB", "--ctx-size", "256"]


def start(args, name):
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"kylin-{name}-{port}.log"
    proc = subprocess.Popen([kylin_bin(), "serve", *args, "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, log, seconds=60)
    return proc, base


def states(base):
    data = httpx.get(base + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"]["value"] for m in data}


def chat(client, model, max_tokens=4):
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def server():
    if not (SMOL / "config.json").is_file():
        pytest.fail(f"{SMOL} is missing; run scripts/setup.sh")
    with tempfile.TemporaryDirectory() as models_dir:
        (Path(models_dir) / "smol").symlink_to(SMOL)
        (Path(models_dir) / "tiny").symlink_to(TINY)
        proc, base = start(["--models-dir", models_dir, "--models-memory", "290MiB", *COMMON], "models-dir")
        try:
            yield base
        finally:
            proc.terminate()
            assert proc.wait(timeout=60) == 0


def client_for(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_load_on_demand_and_the_least_recently_used_is_unloaded(server):
    client = client_for(server)
    listed = sorted(m.id for m in client.models.list())
    assert listed == ["smol", "tiny"]
    assert states(server) == {"smol": "unloaded", "tiny": "unloaded"}

    # SmolLM2 greets: this is the real model answering, loaded by the request.
    assert "Hello" in chat(client, "smol", max_tokens=8)
    assert states(server) == {"smol": "loaded", "tiny": "unloaded"}

    # The budget holds one: loading the tiny model unloads SmolLM2, and the other way round.
    assert chat(client, "tiny")
    assert states(server) == {"smol": "unloaded", "tiny": "loaded"}
    assert "Hello" in chat(client, "smol", max_tokens=8)
    assert states(server) == {"smol": "loaded", "tiny": "unloaded"}

    metrics = httpx.get(server + "/metrics", timeout=10).text
    assert "kylin:model_loads_total 3" in metrics
    assert "kylin:model_unloads_total 2" in metrics
    assert 'kylin:num_requests_running{model_name="smol"} 0' in metrics

    with pytest.raises(openai.NotFoundError) as e:
        chat(client, "no-such-model")
    assert e.value.body["code"] == "model_not_found"
    assert "`smol`" in e.value.body["message"] and "`tiny`" in e.value.body["message"]


def test_a_pinned_model_is_never_unloaded_for_room(server):
    client = client_for(server)
    chat(client, "smol")
    pinned = httpx.post(server + "/models/pin", json={"model": "smol"}, timeout=10).json()
    assert pinned["status"]["pinned"] is True
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, "tiny")
    assert e.value.status_code == 503
    assert e.value.body["code"] == "memory_budget_exceeded"
    assert "pinned" in e.value.body["message"]
    assert states(server)["smol"] == "loaded"

    httpx.post(server + "/models/pin", json={"model": "smol", "pinned": False}, timeout=10).raise_for_status()
    assert chat(client, "tiny")
    assert states(server) == {"smol": "unloaded", "tiny": "loaded"}


def test_a_model_serving_a_stream_is_not_unloaded_and_loading_requests_wait(server):
    client = client_for(server)
    # Unloaded: two requests at once, one loads the model and the other waits for it.
    httpx.post(server + "/models/unload", json={"model": "smol"}, timeout=60).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: chat(client, "smol", max_tokens=8), range(2)))
    assert all("Hello" in a for a in answers) and answers[0] == answers[1]

    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Count from one to one hundred in words."}],
        max_tokens=200, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "smol"

    # The rest of the stream is read as it arrives, and the moment its last chunk came is kept.
    def read_rest():
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, time.monotonic()

    pool = concurrent.futures.ThreadPoolExecutor(2)
    rest = pool.submit(read_rest)
    busy = httpx.post(server + "/models/unload", json={"model": "smol"}, timeout=10)
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "model_busy"
    # Nor does a request for the other model unload it: that one waits for the stream to end,
    # so its answer can only come after the stream's last chunk (however fast the machine is).
    assert not rest.done(), "the stream ended before the test could ask for the other model"
    waiting = pool.submit(lambda: (chat(client, "tiny"), time.monotonic()))
    text, stream_ended = rest.result(timeout=120)
    answer, answered = waiting.result(timeout=120)
    assert text and answer
    assert answered > stream_ended
    assert states(server) == {"smol": "unloaded", "tiny": "loaded"}


def test_errors_keep_each_apis_shape(server):
    # The Anthropic route answers in Anthropic's error shape.
    r = httpx.post(server + "/v1/messages", json={"model": "nope", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.get(server + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405


def test_a_models_file_gives_options_and_pins(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "small").symlink_to(SMOL)
    config = tmp_path / "models.toml"
    config.write_text(f"""
[defaults]
kv-memory = "16MiB"
ctx-size = 256
threads = 1

[models.assistant]
path = "models/small"
pinned = true

[models.tiny-q8]
path = "{TINY}"
quantize = "q8_0"
""")
    proc, base = start(["--models", str(config), "--host", "127.0.0.1"], "models-file")
    try:
        # The pinned model loads at start, without a request.
        deadline = time.time() + 60
        while states(base)["assistant"] != "loaded" and time.time() < deadline:
            time.sleep(0.2)
        assert states(base) == {"assistant": "loaded", "tiny-q8": "unloaded"}
        client = client_for(base)
        assert "Hello" in chat(client, "assistant", max_tokens=8)
        assert chat(client, "tiny-q8")
        models = {m["id"]: m for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]}
        assert models["assistant"]["max_model_len"] == 256
        assert models["assistant"]["status"]["pinned"] is True
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0

    config.write_text('[models.bad]\npath = "models/small"\nkv-memroy = "1GiB"\n')
    bad = subprocess.run([kylin_bin(), "serve", "--models", str(config)], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "[models.bad]" in bad.stderr and "--kv-memroy" in bad.stderr


def test_the_api_key_guards_the_admin_routes_too(tmp_path):
    (tmp_path / "tiny").symlink_to(TINY)
    proc, base = start(["--models-dir", str(tmp_path), "--api-key", "sesame", *COMMON], "models-key")
    try:
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        for method, route in [("GET", "/v1/models"), ("POST", "/models/load"), ("POST", "/models/unload"),
                              ("POST", "/models/pin"), ("POST", "/v1/chat/completions")]:
            r = httpx.request(method, base + route, json={"model": "tiny"}, timeout=10)
            assert r.status_code == 401, route
            assert r.json()["error"]["code"] == "invalid_api_key"
        keyed = httpx.post(base + "/models/load", json={"model": "tiny"},
                           headers={"Authorization": "Bearer sesame"}, timeout=60)
        assert keyed.status_code == 200 and keyed.json()["status"]["value"] == "loaded"
        client = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        assert chat(client, "tiny")
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
