"""End to end: speculative decoding behind the server, from the official `openai` client.

Two `kylin serve` processes of Qwen2.5-Coder-0.5B-Instruct (`--quantize q8_0`), one with
`--speculative-tokens 8` (n-gram prompt lookup), on free 127.0.0.1 ports. The same requests go
to both: a code edit that copies its input, a structured extraction under a JSON schema, tool
calls, seeded sampling and a streamed answer. The answers must be identical, and the
speculating server's `/metrics` must show proposals accepted; the constrained ones must
validate. Nothing leaves the loopback interface.
"""

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from test_agents import KEY, QWEN, QWEN_NAME, TOOLS, Served, check_calls
from test_openai_server import http

SOURCE = Path(__file__).resolve().parents[2] / "testdata/data/python-json-module.py"

FUNCTIONS = {
    "type": "object",
    "properties": {
        "functions": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "def_line": {"type": "string"}},
                "required": ["name", "def_line"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["functions"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def servers():
    if not (QWEN / "config.json").is_file():
        pytest.fail(f"{QWEN} is missing; run scripts/setup.sh")
    plain = Served(QWEN, "--quantize", "q8_0")
    try:
        spec = Served(QWEN, "--quantize", "q8_0", "--speculative-tokens", "8")
    except Exception:
        plain.stop()
        raise
    try:
        yield plain, spec
    finally:
        assert plain.stop() == 0
        assert spec.stop() == 0


def accepted(server):
    """The speculating server's accepted proposals so far (`/metrics`)."""
    status, _, body = http(server.base, "GET", "/metrics", key=KEY)
    assert status == 200
    for line in body.splitlines():
        if line.startswith("kylin:spec_decode_num_accepted_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no kylin:spec_decode_num_accepted_tokens_total in /metrics")


def both(servers, **request):
    """The same chat completion from both servers; returns both choices' messages."""
    request.setdefault("temperature", 0)
    out = []
    for server in servers:
        r = server.openai().chat.completions.create(model=QWEN_NAME, **request)
        out.append(r.choices[0])
    return out


def code_window(start, end):
    return "\n".join(SOURCE.read_text().splitlines()[start:end])


def test_a_code_edit_is_identical_and_its_proposals_are_accepted(servers):
    before = accepted(servers[1])
    prompt = ("Add the comment `# Decoder state.` on its own line before the first assignment, and reply with "
              f"the whole modified code in one python block.\n\n```python\n{code_window(14, 60)}\n```")
    plain, spec = both(servers, messages=[{"role": "user", "content": prompt}], max_tokens=400)
    assert spec.message.content == plain.message.content
    assert spec.finish_reason == plain.finish_reason
    # The answer copies the window: most of it comes from accepted proposals.
    assert accepted(servers[1]) - before > 50


def test_a_structured_extraction_speculates_under_its_schema(servers):
    before = accepted(servers[1])
    fmt = {"type": "json_schema", "json_schema": {"name": "functions", "schema": FUNCTIONS, "strict": True}}
    prompt = ("List every function defined in this code with its `def` line exactly as written.\n\n"
              f"```python\n{code_window(130, 200)}\n```")
    plain, spec = both(servers, messages=[{"role": "user", "content": prompt}], response_format=fmt, max_tokens=400)
    assert spec.message.content == plain.message.content
    if plain.finish_reason == "stop":
        jsonschema.validate(json.loads(spec.message.content), FUNCTIONS)
    assert accepted(servers[1]) - before > 10


def test_tool_calls_are_identical(servers):
    plain, spec = both(servers, messages=[{"role": "user", "content": "What's the weather in Lisbon, in celsius?"}],
                       tools=TOOLS, tool_choice="required", max_tokens=80)
    calls = check_calls(spec.message)
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in check_calls(plain.message)
    ]


def test_seeded_sampling_and_streaming_are_identical(servers):
    prompt = f"Repeat this code exactly:\n\n```python\n{code_window(200, 230)}\n```"
    messages = [{"role": "user", "content": prompt}]
    plain, spec = both(servers, messages=messages, temperature=0.8, top_p=0.95, seed=7, max_tokens=200)
    assert spec.message.content == plain.message.content
    streamed = servers[1].openai().chat.completions.create(model=QWEN_NAME, messages=messages, temperature=0,
                                                           max_tokens=200, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == both(servers[:1], messages=messages, max_tokens=200)[0].message.content


def test_a_request_turns_speculation_off_or_down_and_too_many_is_a_400(servers):
    prompt = f"Repeat this code exactly:\n\n```python\n{code_window(230, 260)}\n```"
    messages = [{"role": "user", "content": prompt}]
    before = accepted(servers[1])
    plain, spec = both(servers, messages=messages, max_tokens=150, extra_body={"speculative_tokens": 0})
    assert spec.message.content == plain.message.content
    assert accepted(servers[1]) == before
    (two,) = both(servers[1:], messages=messages, max_tokens=150, extra_body={"speculative_tokens": 2})
    assert two.message.content == plain.message.content
    for server, message in ((servers[1], "--speculative-tokens 8"), (servers[0], "runs without")):
        with pytest.raises(openai.BadRequestError) as e:
            server.openai().chat.completions.create(model=QWEN_NAME, messages=messages, max_tokens=5,
                                                    extra_body={"speculative_tokens": 9})
        assert e.value.body["param"] == "speculative_tokens" and message in e.value.body["message"], e.value.body
