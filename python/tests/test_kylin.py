"""The `kylin` wheel from Python, as its users call it (vLLM's offline API).

Runs on the tiny fixtures of testdata/ and tests/fixtures/retrieval, SmolLM2-135M-Instruct and
all-MiniLM-L6-v2 from KYLIN_MODELS (scripts/setup.sh fetches them); `kylin run` (KYLIN_BIN) is
the reference for the generated tokens.
"""

import json
import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

import kylin

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "testdata"
MODELS = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache" / "kylin-models"))
SMOL = MODELS / "smollm2-135m-instruct"
TINY = SHARED / "fixtures" / "tiny-qwen3"
RETRIEVAL = ROOT / "tests" / "fixtures" / "retrieval"


def kylin_run(model, *args):
    # The package's default precision is f32 (exact against transformers); `kylin run`'s is
    # auto, BF16 where the CPU has BF16 kernels: the same request asks for f32 on both.
    binary = os.environ.get("KYLIN_BIN", str(ROOT / "target" / "release" / "kylin"))
    out = subprocess.run([binary, "run", str(model), "--json", "--threads", "2", "--precision", "f32", *args],
                         check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def smol():
    return kylin.LLM(str(SMOL), threads=2, ctx_size=1024, max_seqs=8)


def test_generate_gives_the_tokens_of_kylin_run(smol):
    params = kylin.SamplingParams(temperature=0, max_tokens=24)
    for prompt in ["The capital of France is", "def fibonacci(n):"]:
        want = kylin_run(SMOL, "-p", prompt, "--temperature", "0", "--max-tokens", "24")
        out = smol.generate([prompt], params)[0]
        assert out.prompt_token_ids == want["prompt_ids"]
        assert out.outputs[0].token_ids == want["generated_ids"]
        assert out.outputs[0].text == want["text"]
        assert out.outputs[0].finish_reason == want["finish_reason"]


def test_generate_on_a_tiny_fixture_from_token_ids():
    llm = kylin.LLM(str(TINY), threads=2, ctx_size=256)
    ids = [9707, 11, 1879, 0, 358]
    want = kylin_run(TINY, "--ids", ",".join(map(str, ids)), "--temperature", "0", "--max-tokens", "12",
                     "--ignore-eos")
    out = llm.generate({"prompt_token_ids": ids}, kylin.SamplingParams(temperature=0, max_tokens=12,
                                                                       ignore_eos=True))[0]
    assert out.outputs[0].token_ids == want["generated_ids"]


def test_batched_prompts_equal_each_alone_and_streams_equal_whole(smol):
    params = kylin.SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    prompts = ["Once upon a time", "The best way to learn Python is", "1, 2, 3,", "Hello"]
    together = smol.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        alone = smol.generate(prompt, params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs
        streamed = list(smol.stream(prompt, params))
        assert "".join(s.text for s in streamed) == out.outputs[0].text
        assert streamed[-1].finish_reason == "length"
    # logprobs: the chosen token's among each position's entries, greedy = the best.
    first = together[0].outputs[0]
    for tok, entry in zip(first.token_ids, first.logprobs):
        assert tok in entry and entry[tok] == max(entry.values())


def test_speculative_decoding_keeps_the_outputs(smol):
    prompts = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
               "def add(a, b):\n    return a + b\n\ndef add(a, b):"]
    params = kylin.SamplingParams(temperature=0, max_tokens=24)
    want = [o.outputs[0].token_ids for o in smol.generate(prompts, params)]
    for options in [{"speculative_tokens": 8}, {"draft_model": str(SMOL)}]:
        fast = kylin.LLM(str(SMOL), threads=2, ctx_size=1024, max_seqs=8, **options)
        assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want, options
    with pytest.raises(kylin.KylinError) as e:
        kylin.LLM(str(SMOL), threads=2, ctx_size=1024, draft_model=str(TINY))
    assert e.value.code == "VOCAB_MISMATCH"


def test_the_mtp_head_proposes_and_keeps_the_outputs(smol):
    # A Qwen3.5 fixture with a seeded multi-token-prediction head (scripts/make_mtp_fixtures.py):
    # the same tokens with the head proposing as without, greedy and seeded.
    tiny_mtp = ROOT / "tests" / "fixtures" / "families" / "fixtures" / "tiny-qwen3.5-mtp"
    prompts = [{"prompt_token_ids": [(i * 7919 + 13 * k) % 1000 for i in range(8 + 5 * k)]} for k in range(4)]
    plain = kylin.LLM(str(tiny_mtp), threads=2, ctx_size=256, max_seqs=4)
    fast = kylin.LLM(str(tiny_mtp), threads=2, ctx_size=256, max_seqs=4, mtp=True, speculative_tokens=3,
                     speculative_step_tokens=16)
    for params in [kylin.SamplingParams(temperature=0, max_tokens=24),
                   kylin.SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24)]:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want
        # A request may ask for fewer proposals, or none, but not more than the engine's.
        params.speculative_tokens = 0
        assert [o.outputs[0].token_ids for o in fast.generate(prompts, params)] == want
        params.speculative_tokens = 4
        with pytest.raises(kylin.KylinError) as e:
            fast.generate(prompts, params)
        assert e.value.code == "INPUT_INVALID" and "speculative_tokens" in str(e.value)
        params.speculative_tokens = None
    # A model without the head is refused, naming the tensor it lacks.
    with pytest.raises(kylin.KylinError) as e:
        kylin.LLM(str(SMOL), threads=2, ctx_size=1024, mtp=True)
    assert e.value.code == "TENSOR_MISSING" and "mtp.fc.weight" in str(e.value)


def test_chat_sampling_n_and_seeds(smol):
    r = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                  kylin.SamplingParams(temperature=0, max_tokens=12))[0]
    assert "Paris" in r.outputs[0].text
    params = kylin.SamplingParams(temperature=1.0, top_p=0.9, seed=7, n=3, max_tokens=8)
    a = smol.generate("Tell me a story", params)[0]
    b = smol.generate("Tell me a story", params)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def test_prompt_logprobs_match_transformers(smol):
    ref = json.loads((ROOT / "tests/fixtures/prompt_logprobs/smollm2-135m-instruct.json").read_text())
    out = smol.generate(ref["prompt"], kylin.SamplingParams(max_tokens=0, prompt_logprobs=5))[0]
    assert out.prompt_logprobs[0] is None
    for entry, want in zip(out.prompt_logprobs[1:], ref["positions"]):
        assert abs(entry[want["token"]] - want["logprob"]) < 1e-3
    assert out.outputs[0].token_ids == []


def test_errors_are_kylin_errors_with_codes(smol):
    with pytest.raises(kylin.KylinError) as e:
        smol.generate({"prompt_token_ids": [10**6]})
    assert e.value.code == "INPUT_INVALID"
    with pytest.raises(kylin.KylinError) as e:
        smol.generate("word " * 2000)
    assert e.value.code == "CONTEXT_OVERFLOW"
    with pytest.raises(kylin.KylinError) as e:
        kylin.LLM(str(ROOT / "no-such-model"))
    assert e.value.code in ("FILE_NOT_FOUND", "CONFIG_MISSING", "INPUT_INVALID", "IO_ERROR")
    with pytest.raises(kylin.KylinError) as e:
        kylin.LLM(str(TINY), flux_capacitor=True)
    assert e.value.code == "INPUT_INVALID"
    with pytest.raises(kylin.KylinError) as e:
        smol.embed("x")
    assert e.value.code == "INPUT_INVALID"


def test_the_gil_is_released_while_the_engine_runs(smol):
    ticks = 0
    stop = False

    def count():
        nonlocal ticks
        while not stop:
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=count)
    t.start()
    started = time.time()
    smol.generate(["A long story about a dragon:"], kylin.SamplingParams(temperature=0, max_tokens=48))
    elapsed = time.time() - started
    stop = True
    t.join()
    # A thread that never got the GIL would have ticked a few times at most.
    assert ticks > elapsed * 100, (ticks, elapsed)


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_embed_matches_sentence_transformers():
    ref = json.loads((RETRIEVAL / "reference/all-minilm-l6-v2.json").read_text())
    llm = kylin.LLM(str(MODELS / "all-minilm-l6-v2"), threads=2)
    outs = llm.embed(ref["texts"])
    for out, ids, want in zip(outs, ref["input_ids"], ref["embeddings"]):
        assert out.prompt_token_ids == ids
        assert cosine(out.outputs.embedding, want) >= 0.9999
    short = llm.embed(ref["texts"][0], dimensions=32)[0].outputs.embedding
    assert len(short) == 32 and abs(sum(x * x for x in short) - 1) < 1e-5
    tiny = json.loads((RETRIEVAL / "reference/tiny-bert-cls-embed.json").read_text())
    cls = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-bert-cls-embed"), threads=1)
    for out, want in zip(cls.embed(tiny["texts"]), tiny["embeddings"]):
        assert cosine(out.outputs.embedding, want) >= 0.9999


def test_score_with_a_cross_encoder():
    ref = json.loads((RETRIEVAL / "reference/tiny-xlmr-reranker.json").read_text())
    llm = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-xlmr-reranker"), threads=1)
    scores = llm.score(ref["query"], ref["documents"])
    assert all(abs(s - w) < 1e-5 for s, w in zip(scores, ref["scores"]))


def test_decoder_embedder_and_reranker():
    """Qwen3-Embedding- and Qwen3-Reranker-shaped fixtures on the batching engine."""
    ref = json.loads((RETRIEVAL / "reference/tiny-qwen3-embedding.json").read_text())
    llm = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-qwen3-embedding"), threads=1)
    for out, ids, want in zip(llm.embed(ref["texts"]), ref["input_ids"], ref["embeddings"]):
        assert out.prompt_token_ids == ids
        assert cosine(out.outputs.embedding, want) >= 0.9999
    query = llm.embed(ref["query"], prompt_name="query")[0].outputs.embedding
    assert cosine(query, ref["query_embedding"]) >= 0.9999
    rr = json.loads((RETRIEVAL / "reference/tiny-qwen3-reranker.json").read_text())
    reranker = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-qwen3-reranker"), threads=1)
    scores = reranker.score(rr["query"], rr["documents"])
    assert all(abs(s - w) < 1e-4 for s, w in zip(scores, rr["scores"]))
    custom = reranker.score(rr["query"], rr["documents"], instruction=rr["custom_instruction"])
    assert all(abs(s - w) < 1e-4 for s, w in zip(custom, rr["custom_scores"]))
    # The same directory as a plain language model, and as an embedder on request.
    as_lm = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-qwen3-reranker"), threads=1, task="generate")
    with pytest.raises(kylin.KylinError) as e:
        as_lm.score(rr["query"], rr["documents"])
    assert e.value.code == "INPUT_INVALID"
    as_embedder = kylin.LLM(str(RETRIEVAL / "fixtures/tiny-qwen3-reranker"), threads=1, task="embed")
    v = as_embedder.embed("The cat sits on the mat.")[0].outputs.embedding
    assert len(v) == 32 and abs(sum(x * x for x in v) - 1) < 1e-5


def test_chat_with_an_image_gives_transformers_tokens():
    vision = ROOT / "tests" / "fixtures" / "vision_model"
    reference = json.loads((vision / "chat.json").read_text())
    llm = kylin.LLM(str(ROOT / "tests" / "fixtures" / "tiny-qwen3.5-vl-mrope"), threads=2, ctx_size=256)
    params = kylin.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    png = (vision / "chat.png").read_bytes()
    import base64
    for url in ["data:image/png;base64," + base64.b64encode(png).decode(), "file://" + str(vision / "chat.png")]:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": reference["question"]}]}]
        out = llm.chat(messages, params)[0]
        assert out.prompt_token_ids == reference["prompt_ids"]
        assert out.outputs[0].token_ids == reference["greedy_new_ids"]
        assert out.outputs[0].text == reference["greedy_text"]
    # Not an image: Kylin's error with its code.
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]
    with pytest.raises(kylin.KylinError) as e:
        llm.chat(bad, params)
    assert e.value.code == "IMAGE_INVALID" and "IMAGE_FORMAT" in str(e.value)


@pytest.mark.parametrize("fixture,reference", [("tiny-gemma3-vl-pooled", "chat_gemma3.json"),
                                               ("tiny-gemma4-vl-bidir", "chat_gemma4.json")])
def test_chat_with_an_image_on_gemma_gives_transformers_prompt_and_tokens(fixture, reference):
    vision = ROOT / "tests" / "fixtures" / "vision_model"
    reference = json.loads((vision / reference).read_text())
    llm = kylin.LLM(str(ROOT / "tests" / "fixtures" / fixture), threads=2, ctx_size=256)
    params = kylin.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(vision / "chat.png")}},
                                             {"type": "text", "text": reference["question"]}]}]
    out = llm.chat(messages, params)[0]
    # Gemma 3's image sequence goes into the rendered text, its newlines merged as transformers
    # does; Gemma 4's <|image|> becomes <|image>, the image's tokens and <image|>.
    assert out.prompt_token_ids == reference["prompt_ids"]
    assert out.outputs[0].token_ids == reference["greedy_new_ids"]
