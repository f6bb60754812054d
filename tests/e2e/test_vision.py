"""End to end: images in chat through the official `openai` client, on loopback.

The tiny Qwen3.5 vision-language model of tests/fixtures/tiny-qwen3.5-vl-mrope (with a
tokenizer, a chat template and a preprocessor configuration: tests/fixtures/
make_vision_chat_fixture.py) is asked about a real photograph (tests/fixtures/vision_model/
chat.png), sent as a base64 `data:` URL and as a local file; the answer must be the tokens
transformers generated for the same chat and image (tests/fixtures/vision_model/chat.json).
Bad images get the API's 400 naming the field. Gemma 3's and Gemma 4's tiny vision-language
fixtures answer the same photograph as transformers does.
"""

import base64
import json

import anthropic
import httpx
import openai
import pytest

from test_models_dir import start
from test_retrieval import MODELS, ROOT

MODEL = ROOT / "tests/fixtures/tiny-qwen3.5-vl-mrope"
IMAGES = ROOT / "tests/fixtures/vision_model"
REFERENCE = json.loads((IMAGES / "chat.json").read_text())
PNG = (IMAGES / "chat.png").read_bytes()


def data_url(data, mime="image/png"):
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_chat(url):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": REFERENCE["question"]}]}]


@pytest.fixture(scope="module")
def server():
    proc, base = start([str(MODEL), "--host", "127.0.0.1", "--threads", "2", "--precision", "f32",
                        "--served-model-name", "vl", "--allowed-local-media-path", str(IMAGES)], "vision")
    try:
        yield base
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def client_for(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_an_image_as_a_data_url_gets_transformers_answer(server):
    reply = client_for(server).chat.completions.create(
        model="vl", messages=image_chat(data_url(PNG)), max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == REFERENCE["greedy_text"]
    # The prompt as transformers' processor expanded it: one token per merged patch.
    assert reply.usage.prompt_tokens == len(REFERENCE["prompt_ids"])
    assert reply.usage.completion_tokens == 10


def test_a_local_file_and_a_stream_give_the_same_answer(server):
    client = client_for(server)
    stream = client.chat.completions.create(
        model="vl", messages=image_chat("file://" + str(IMAGES / "chat.png")), max_tokens=10, temperature=0,
        stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == REFERENCE["greedy_text"]
    # The same image again: the prefix cache serves its tokens.
    again = client.chat.completions.create(model="vl", messages=image_chat(data_url(PNG)), max_tokens=10,
                                           temperature=0)
    assert again.choices[0].message.content == REFERENCE["greedy_text"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    # Encoded once (by the first test), found among the latest encodings since.
    metrics = httpx.get(server + "/metrics", timeout=10).text
    assert "kylin:images_encoded_total 1" in metrics.replace('{model_name="vl"}', ""), metrics
    assert "kylin:image_cache_hits_total 0" not in metrics.replace('{model_name="vl"}', "")


def test_the_responses_and_anthropic_apis_take_images_too(server):
    # OpenAI's Responses API: an `input_image` part with a data: URL.
    response = client_for(server).responses.create(
        model="vl", max_output_tokens=10, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(PNG)},
                                             {"type": "input_text", "text": REFERENCE["question"]}]}])
    assert response.output_text == REFERENCE["greedy_text"]
    assert response.usage.input_tokens == len(REFERENCE["prompt_ids"])
    # Anthropic's Messages API: an `image` block with a base64 source.
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PNG).decode()}},
              {"type": "text", "text": REFERENCE["question"]}]
    message = client.messages.create(model="vl", max_tokens=10, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": blocks}])
    assert message.content[0].text == REFERENCE["greedy_text"]
    # Anthropic counts the tokens read from the prefix cache apart (the image was seen before).
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(REFERENCE["prompt_ids"])
    count = client.messages.count_tokens(model="vl", messages=[{"role": "user", "content": blocks}])
    assert count.input_tokens == len(REFERENCE["prompt_ids"])
    # A URL source is refused in Anthropic's error shape.
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="vl", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    assert e.value.body["type"] == "error" and "fetches nothing" in e.value.body["error"]["message"]


def test_bad_images_get_a_400_naming_the_field(server):
    client = client_for(server)
    at = "messages[0].content[0].image_url.url"
    cases = [
        (data_url(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "image/gif"), "IMAGE_INVALID", "IMAGE_FORMAT"),
        (data_url(PNG[: len(PNG) // 2]), "IMAGE_INVALID", "IMAGE_DECODE"),
        ("data:image/png;base64,***", "image_invalid", "base64"),
        ("https://example.com/cat.png", "unsupported_parameter", "fetches nothing"),
        ("file:///etc/hostname", "image_invalid", "outside the directory"),
        ("file://" + str(IMAGES / "missing.png"), "image_invalid", "cannot open"),
    ]
    for url, code, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="vl", messages=image_chat(url), max_tokens=4)
        error = e.value.body
        assert error["param"] == at and error["code"] == code and needle in error["message"], (url, error)


def test_a_model_without_a_vision_tower_refuses_images(tmp_path):
    smol = MODELS / "smollm2-135m-instruct"
    proc, base = start([str(smol), "--host", "127.0.0.1", "--threads", "1", "--kv-memory", "16MiB",
                        "--ctx-size", "256"], "vision-text")
    try:
        r = httpx.post(base + "/v1/chat/completions", json={"messages": image_chat(data_url(PNG)), "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "unsupported_parameter"
        assert "takes no images" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


GEMMA = ROOT / "tests/fixtures/tiny-gemma3-vl-pooled"
GEMMA_REFERENCE = json.loads((IMAGES / "chat_gemma3.json").read_text())


@pytest.fixture(scope="module")
def gemma_server():
    proc, base = start([str(GEMMA), "--host", "127.0.0.1", "--threads", "2", "--precision", "f32",
                        "--served-model-name", "gemma"], "vision-gemma3")
    try:
        yield base
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_gemma3_answers_an_image_as_transformers_does(gemma_server):
    """Gemma 3 (tests/fixtures/make_gemma3_vision_reference.py): the SigLIP tower, the image's
    sequence put in the prompt's text with its newlines, its tokens attending to each other."""
    client = client_for(gemma_server)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                             {"type": "text", "text": GEMMA_REFERENCE["question"]}]}]
    reply = client.chat.completions.create(model="gemma", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == GEMMA_REFERENCE["greedy_text"]
    assert reply.usage.prompt_tokens == len(GEMMA_REFERENCE["prompt_ids"])
    # Streamed, the same text.
    stream = client.chat.completions.create(model="gemma", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == GEMMA_REFERENCE["greedy_text"]


def test_gemma3_through_the_anthropic_api_and_its_token_count(gemma_server):
    client = anthropic.Anthropic(base_url=gemma_server, api_key="unused", max_retries=0, timeout=120)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PNG).decode()}},
              {"type": "text", "text": GEMMA_REFERENCE["question"]}]
    message = client.messages.create(model="gemma", max_tokens=10, messages=[{"role": "user", "content": blocks}],
                                     extra_body={"temperature": 0})
    assert message.content[0].text == GEMMA_REFERENCE["greedy_text"]
    # The count is the prompt transformers' processor makes: the image's sequence with its
    # newlines merged into the template's.
    count = client.messages.count_tokens(model="gemma", messages=[{"role": "user", "content": blocks}])
    assert count.input_tokens == len(GEMMA_REFERENCE["prompt_ids"])


GEMMA4 = ROOT / "tests/fixtures/tiny-gemma4-vl-bidir"
GEMMA4_REFERENCE = json.loads((IMAGES / "chat_gemma4.json").read_text())


@pytest.fixture(scope="module")
def gemma4_server():
    proc, base = start([str(GEMMA4), "--host", "127.0.0.1", "--threads", "2", "--precision", "f32",
                        "--served-model-name", "gemma4"], "vision-gemma4")
    try:
        yield base
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_gemma4_answers_an_image_as_transformers_does(gemma4_server):
    """Gemma 4 (tests/fixtures/make_gemma4_vision_reference.py): the image resized within its
    budget of patches, the tower with clipped linears, the image's tokens seeing each other on
    the sliding layers; as the openai client sends it, streamed, and counted by the Anthropic
    API."""
    client = client_for(gemma4_server)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                             {"type": "text", "text": GEMMA4_REFERENCE["question"]}]}]
    reply = client.chat.completions.create(model="gemma4", messages=messages, max_tokens=10, temperature=0)
    assert reply.choices[0].message.content == GEMMA4_REFERENCE["greedy_text"]
    assert reply.usage.prompt_tokens == len(GEMMA4_REFERENCE["prompt_ids"])
    stream = client.chat.completions.create(model="gemma4", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == GEMMA4_REFERENCE["greedy_text"]
    anthropic_client = anthropic.Anthropic(base_url=gemma4_server, api_key="unused", max_retries=0, timeout=120)
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(PNG).decode()}},
              {"type": "text", "text": GEMMA4_REFERENCE["question"]}]
    count = anthropic_client.messages.count_tokens(model="gemma4", messages=[{"role": "user", "content": blocks}])
    assert count.input_tokens == len(GEMMA4_REFERENCE["prompt_ids"])


def test_tokenize_takes_images_as_chat_completions_do(gemma4_server, server):
    """`/tokenize` with `messages` holding an image gives the prompt the model's processor
    makes: Gemma 4's placeholder expanded, Qwen's repeated, as in the chat's own prompt."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                             {"type": "text", "text": GEMMA4_REFERENCE["question"]}]}]
    r = httpx.post(gemma4_server + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == GEMMA4_REFERENCE["prompt_ids"]
    assert r.json()["count"] == len(GEMMA4_REFERENCE["prompt_ids"])
    r = httpx.post(server + "/tokenize", json={"messages": image_chat(data_url(PNG))}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == REFERENCE["prompt_ids"]
    # A broken image is the same 400 as in a chat.
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(b"not an image")}}]}]
    r = httpx.post(gemma4_server + "/tokenize", json={"messages": bad}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url", r.text
    assert r.json()["error"]["code"] == "IMAGE_INVALID"


def test_mm_processor_kwargs_set_the_image_budget_per_request(gemma4_server, server):
    """`mm_processor_kwargs` (vLLM's name): Gemma 4's `max_soft_tokens` and Qwen's
    `min_pixels`/`max_pixels` for one request; a setting the model's processor does not read, a
    value out of range or an unknown key is a 400 naming it."""
    client = client_for(gemma4_server)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                             {"type": "text", "text": GEMMA4_REFERENCE["question"]}]}]
    at_140 = GEMMA4_REFERENCE["at_140_soft_tokens"]
    reply = client.chat.completions.create(model="gemma4", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"mm_processor_kwargs": {"max_soft_tokens": 140}})
    assert reply.usage.prompt_tokens == len(at_140["prompt_ids"])
    assert reply.choices[0].message.content == at_140["greedy_text"]
    r = httpx.post(gemma4_server + "/tokenize",
                   json={"messages": messages, "mm_processor_kwargs": {"max_soft_tokens": 140}}, timeout=60)
    assert r.json()["tokens"] == at_140["prompt_ids"]
    for kwargs, param, needle in [
        ({"max_soft_tokens": 100}, "mm_processor_kwargs", "must be one of [70, 140, 280, 560, 1120]; got 100"),
        ({"max_pixels": 4096}, "mm_processor_kwargs", "max_pixels: Gemma 4's image processor does not read it"),
        ({"max_soft_tokens": "many"}, "mm_processor_kwargs.max_soft_tokens", "must be a positive integer"),
        ({"do_pan_and_scan": True}, "mm_processor_kwargs", "do_pan_and_scan: Gemma 4's image processor does not read"),
        ({"do_convert_rgb": False}, "mm_processor_kwargs.do_convert_rgb", "not an image processor setting"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="gemma4", messages=messages, max_tokens=2,
                                           extra_body={"mm_processor_kwargs": kwargs})
        assert e.value.body["param"] == param and needle in e.value.body["message"], (kwargs, e.value.body)
    # Qwen: a smaller pixel budget gives fewer image tokens (the 61 x 45 photograph within 1024
    # pixels: smart_resize gives 32 x 24, 8 x 6 patches of 4 merged 2 x 2 into 12 tokens).
    r = httpx.post(server + "/tokenize", json={"messages": image_chat(data_url(PNG)),
                                               "mm_processor_kwargs": {"min_pixels": 1024, "max_pixels": 1024}},
                   timeout=60)
    assert r.status_code == 200, r.text
    image_pad = 1000
    assert REFERENCE["prompt_ids"].count(image_pad) == 24
    assert r.json()["tokens"].count(image_pad) == 12
    assert r.json()["count"] == len(REFERENCE["prompt_ids"]) - 12
    r = httpx.post(server + "/v1/chat/completions", json={"messages": image_chat(data_url(PNG)), "max_tokens": 2,
                                                          "mm_processor_kwargs": {"max_soft_tokens": 140}},
                   timeout=60)
    assert r.status_code == 400 and "Qwen's image processor does not read it" in r.json()["error"]["message"]


def test_gemma3_pan_and_scan_on_request(gemma_server):
    """`mm_processor_kwargs: {"do_pan_and_scan": true}`: a 520 x 260 picture becomes the whole
    image and two crops in the processor's sentence, as transformers makes the prompt."""
    wide = (IMAGES / "wide.png").read_bytes()
    reference = GEMMA_REFERENCE["pan_and_scan"]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(wide)}},
                                             {"type": "text", "text": GEMMA_REFERENCE["question"]}]}]
    kwargs = {"mm_processor_kwargs": {"do_pan_and_scan": True}}
    r = httpx.post(gemma_server + "/tokenize", json={"messages": messages, **kwargs}, timeout=60)
    assert r.json()["tokens"] == reference["prompt_ids"]
    reply = client_for(gemma_server).chat.completions.create(model="gemma", messages=messages, max_tokens=10,
                                                             temperature=0, extra_body=kwargs)
    assert reply.usage.prompt_tokens == len(reference["prompt_ids"])
    assert reply.choices[0].message.content == reference["greedy_text"]
    # Off (the default), the same picture is one image.
    r = httpx.post(gemma_server + "/tokenize", json={"messages": messages}, timeout=60)
    assert r.json()["count"] == len(GEMMA_REFERENCE["prompt_ids"])


def test_a_servers_mm_processor_kwargs_are_every_requests_defaults():
    """`kylin serve --mm-processor-kwargs`: the settings every request starts from; a request's
    own `mm_processor_kwargs` overrides them key by key."""
    proc, base = start([str(GEMMA4), "--host", "127.0.0.1", "--threads", "1", "--precision", "f32",
                        "--mm-processor-kwargs", '{"max_soft_tokens": 140}'], "vision-gemma4-140")
    try:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(PNG)}},
                                                 {"type": "text", "text": GEMMA4_REFERENCE["question"]}]}]
        r = httpx.post(base + "/tokenize", json={"messages": messages}, timeout=60)
        assert r.json()["tokens"] == GEMMA4_REFERENCE["at_140_soft_tokens"]["prompt_ids"]
        r = httpx.post(base + "/tokenize", json={"messages": messages, "mm_processor_kwargs": {"max_soft_tokens": 70}},
                       timeout=60)
        assert r.json()["tokens"] == GEMMA4_REFERENCE["prompt_ids"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
