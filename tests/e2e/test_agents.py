"""End to end: what agents use, from the official clients, against `kylin serve`.

Qwen2.5-Coder-0.5B-Instruct (its chat template renders tools in the Hermes syntax) and
SmolLM2-135M-Instruct (its template has no tools: Kylin describes them in a system message)
on free 127.0.0.1 ports: the `openai` client (tools with every tool_choice, streaming tool
calls, a multi-turn tool conversation, JSON schema and JSON object outputs, logit_bias, cached
tokens, the Responses API), the `anthropic` client (messages, tools, streaming, errors), and
LangChain's ChatOpenAI as its users call it (bind_tools, with_structured_output in its three
methods). With a constraint, every sampled output parses and validates, whatever the model's
quality. Nothing leaves the loopback interface; every loop is bounded.
"""

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from test_openai_server import free_port, http, kylin_bin

MODELS = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache" / "kylin-models"))
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct"
SMOL = MODELS / "smollm2-135m-instruct"
KEY = "agent-key"
# The anthropic client has no sampling parameters; Kylin takes them in the body.
GREEDY = {"temperature": 0}
QWEN_NAME = "qwen2.5-coder-0.5b-instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de", "zh"]}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}


class Served:
    """`kylin serve MODEL` with the default served name, waiting for /health."""

    def __init__(self, model, *extra):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"kylin-agents-{self.port}.log", "w")
        args = [kylin_bin(), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                "--api-key", KEY, "--ctx-size", "2048", *extra]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
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
        self.stop()
        raise RuntimeError("kylin serve was not ready within 120 s")

    def openai(self):
        return openai.OpenAI(base_url=self.base + "/v1", api_key=KEY, max_retries=0, timeout=180)

    def anthropic(self, key=KEY):
        return anthropic.Anthropic(base_url=self.base, api_key=key, max_retries=0, timeout=180)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return None


@pytest.fixture(scope="module")
def qwen():
    if not (QWEN / "config.json").is_file():
        pytest.fail(f"{QWEN} is missing; run scripts/setup.sh")
    s = Served(QWEN)
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def client(qwen):
    return qwen.openai()


def ask(client, text, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=QWEN_NAME, messages=[{"role": "user", "content": text}], **kw)


def check_calls(message, names=None):
    """Every call has an id, a known name and arguments that validate; returns the calls."""
    calls = message.tool_calls or []
    assert calls, message
    for c in calls:
        assert c.id and c.type == "function"
        assert c.function.name in SCHEMAS
        if names is not None:
            assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_the_directory_name_is_the_served_name(qwen, client):
    assert [m.id for m in client.models.list().data] == [QWEN_NAME]
    assert "def" in ask(client, "Write a Python function that adds two numbers.", max_tokens=40).choices[0].message.content


def test_required_and_named_tool_choice_always_give_valid_calls(client):
    r = ask(client, "What's the weather like in Paris, in celsius?", tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    check_calls(r.choices[0].message)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = ask(client, "What's the weather like in Paris?", tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert [c.function.name for c in check_calls(r.choices[0].message)] == ["get_time"]
    # Sampled at temperature 1, many times: every call validates, whatever the model prefers.
    r = ask(client, "Weather in Tokyo?", tools=TOOLS, tool_choice="required", temperature=1.0,
            seed=7, n=6, max_tokens=160, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message)


def test_auto_and_none(client):
    r = ask(client, "Use the get_weather tool to get the weather in Berlin in celsius.", tools=TOOLS, tool_choice="auto")
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(msg)
    else:
        assert msg.content
    r = ask(client, "Say hello.", tools=TOOLS, tool_choice="none", max_tokens=20)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_streamed_tool_calls_add_up_to_the_whole_answer(client):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = ask(client, "Weather in Madrid, celsius?", **kw).choices[0].message.tool_calls
    calls, pieces, reasons = {}, 0, []
    for chunk in ask(client, "Weather in Madrid, celsius?", stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert slot["id"] is None and tc.function.name
                slot["id"], slot["name"] = tc.id, tc.function.name
            slot["arguments"] += tc.function.arguments or ""
            pieces += 1
    assert [r for r in reasons if r] == ["tool_calls"]
    assert pieces > 3, "the arguments should arrive in pieces"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(w.function.name, w.function.arguments) for w in whole]


def test_a_multi_turn_tool_conversation(qwen, client):
    messages = [{"role": "user", "content": "What's the weather in Oslo, in celsius?"}]
    r = client.chat.completions.create(model=QWEN_NAME, messages=messages, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=80)
    call = check_calls(r.choices[0].message)[0]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})})
    # The template shows the model the call and its result.
    rendered = json.loads(http(qwen.base, "POST", "/tokenize", {"messages": messages}, key=KEY)[2])
    assert rendered["count"] > 30
    r = client.chat.completions.create(model=QWEN_NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=60)
    answer = r.choices[0].message
    assert answer.content and not answer.tool_calls
    assert "21" in answer.content, answer.content


def test_json_schema_outputs_validate_every_time(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in (1, 2):
        r = ask(client, "Invent a person.", response_format=fmt, temperature=1.0, seed=seed, n=4, max_tokens=200)
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    r = ask(client, "List two colors as JSON.", response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_logit_bias_and_cached_tokens(client):
    base = ask(client, "Name a fruit.", max_tokens=4)
    first = client.completions.create(model=QWEN_NAME, prompt="The sky is", max_tokens=1, temperature=0, logprobs=0)
    token = first.choices[0].logprobs.tokens[0]
    ids = json.loads(http(str(client.base_url).removesuffix("/").removesuffix("/v1"), "POST", "/tokenize",
                          {"prompt": token, "add_special_tokens": False}, key=KEY)[2])["tokens"]
    banned = client.completions.create(model=QWEN_NAME, prompt="The sky is", max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].text != first.choices[0].text
    again = ask(client, "Name a fruit.", max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == base.choices[0].message.content


def test_the_responses_api(client):
    tools = [{"type": "function", **WEATHER["function"]}]
    r = client.responses.create(model=QWEN_NAME, input="Weather in Rome, celsius?", tools=tools, tool_choice="required",
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    follow = client.responses.create(
        model=QWEN_NAME, temperature=0, max_output_tokens=40,
        input=[{"role": "user", "content": "Weather in Rome, celsius?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees, sunny"}])
    assert follow.output_text
    r = client.responses.create(model=QWEN_NAME, instructions="Answer with code only.",
                                input="Write a Python function that adds two numbers.", temperature=0, max_output_tokens=40)
    assert "def" in r.output_text and r.usage.output_tokens >= 1
    r = client.responses.create(model=QWEN_NAME, input="Invent a person.", temperature=0, max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    with client.responses.stream(model=QWEN_NAME, input="Weather in Rome, celsius?", tools=tools,
                                 tool_choice="required", temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    assert [o.arguments for o in final.output if o.type == "function_call"] == [calls[0].arguments]


def test_the_anthropic_client(qwen):
    a = qwen.anthropic()
    m = a.messages.create(model=QWEN_NAME, max_tokens=40, extra_body=GREEDY, system="Answer with code only.",
                          messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}])
    assert m.role == "assistant" and "def" in m.content[0].text and m.usage.output_tokens >= 1
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    m = a.messages.create(model=QWEN_NAME, max_tokens=100, extra_body=GREEDY, tools=tools, tool_choice={"type": "any"},
                          messages=[{"role": "user", "content": "Weather in Paris, celsius?"}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    m2 = a.messages.create(model=QWEN_NAME, max_tokens=40, extra_body=GREEDY, tools=tools, messages=[
        {"role": "user", "content": "Weather in Paris, celsius?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "25 degrees"}]}])
    assert m2.content[0].type == "text" and m2.content[0].text
    with a.messages.stream(model=QWEN_NAME, max_tokens=100, extra_body=GREEDY, tools=tools,
                           tool_choice={"type": "tool", "name": "get_time"},
                           messages=[{"role": "user", "content": "Time in Tokyo?"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].name == "get_time"
    jsonschema.validate(final.content[-1].input, SCHEMAS["get_time"])
    with a.messages.stream(model=QWEN_NAME, max_tokens=12, extra_body=GREEDY,
                           messages=[{"role": "user", "content": "Count from 1 to 20."}]) as s:
        text = "".join(s.text_stream)
        assert s.get_final_message().stop_reason == "max_tokens"
    assert text
    m = a.messages.create(model=QWEN_NAME, max_tokens=60, extra_body=GREEDY, stop_sequences=["5"],
                          messages=[{"role": "user", "content": "Count from 1 to 10, comma separated."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5" and "5" not in m.content[0].text
    assert a.messages.count_tokens(model=QWEN_NAME, messages=[{"role": "user", "content": "hi"}]).input_tokens > 3
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=QWEN_NAME, max_tokens=10, messages=[{"role": "tool", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        qwen.anthropic(key="wrong").messages.create(model=QWEN_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}])


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


def test_langchain_chat_openai_as_its_users_call_it(qwen):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=qwen.base + "/v1", api_key=KEY, model=QWEN_NAME, temperature=0, max_tokens=120,
                     max_retries=0)
    assert "def" in llm.invoke("Write a Python function that adds two numbers.").content
    assert "".join(c.content for c in llm.stream("Say hello."))
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and isinstance(msg.tool_calls[0]["args"]["city"], str)
    msg = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    assert msg.tool_calls
    for method in ("json_schema", "function_calling"):
        p = llm.with_structured_output(Person, method=method).invoke("Invent a person called Ada.")
        assert isinstance(p, Person) and 0 <= p.age <= 120, method
    d = llm.with_structured_output(None, method="json_mode").invoke("Return a JSON object with a key 'color'.")
    assert isinstance(d, dict)


def test_errors_name_their_field(qwen, client):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hi", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hi", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}})
    assert e.value.body["param"] == "response_format" and "JSON schema" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=QWEN_NAME, messages=[{"role": "user", "content": "hi"},
                                                                  {"role": "tool", "content": "x"}])
    assert e.value.body["param"] == "messages[1].tool_call_id"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "hi", tools=[{"type": "function", "function": {"name": "bad name!"}}])
    assert e.value.body["param"] == "tools[0].function.name"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=QWEN_NAME, input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"
    # The Responses API calls the limit max_output_tokens, and its errors say so.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=QWEN_NAME, input="hi", max_output_tokens=4000)
    assert e.value.body["param"] == "max_output_tokens" and "2048" in e.value.body["message"], e.value.body


def test_smollm2_calls_tools_through_the_fallback_prompt():
    if not (SMOL / "config.json").is_file():
        pytest.fail(f"{SMOL} is missing; run scripts/setup.sh")
    s = Served(SMOL)
    try:
        c = s.openai()
        r = c.chat.completions.create(model="smollm2-135m-instruct", temperature=1.0, seed=3, n=4, max_tokens=120,
                                      messages=[{"role": "user", "content": "What's the weather in Paris?"}],
                                      tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls"
            check_calls(choice.message)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        r = c.chat.completions.create(model="smollm2-135m-instruct", temperature=1.0, seed=5, n=4, max_tokens=200,
                                      messages=[{"role": "user", "content": "Invent a person."}], response_format=fmt)
        for choice in r.choices:
            jsonschema.validate(json.loads(choice.message.content), PERSON)
    finally:
        assert s.stop() == 0


# Qwen3.5's chat template (its published shape, tests/fixtures/qwen3.5/chat_template.jinja) teaches
# the XML calls of Qwen3-Coder and Qwen3.5; served over Qwen2.5-Coder's weights and vocabulary
# (the template's markers are ordinary text there), the calls are constrained, parsed and typed by
# the tools' schemas exactly as for a Qwen3.5 model.
QWEN35_TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3.5" / "chat_template.jinja"
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "days", "hourly"],
            "additionalProperties": False,
        },
    },
}


def test_qwen3_5_xml_tool_calls_are_constrained_parsed_and_typed():
    if not (QWEN / "config.json").is_file():
        pytest.fail(f"{QWEN} is missing; run scripts/setup.sh")
    s = Served(QWEN, "--chat-template", str(QWEN35_TEMPLATE))
    try:
        c = s.openai()
        tools = [FORECAST, TIME]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        kw = dict(model=QWEN_NAME, tools=tools, tool_choice="required", parallel_tool_calls=False)
        question = [{"role": "user", "content": "Forecast for Lyon for the next 3 days, hourly?"}]
        r = c.chat.completions.create(messages=question, temperature=1.0, seed=11, n=4, max_tokens=200, **kw)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            for call in choice.message.tool_calls:
                args = json.loads(call.function.arguments)
                jsonschema.validate(args, schemas[call.function.name])
                if call.function.name == "get_forecast":
                    # Typed by the schema: an integer and a boolean, not the strings the XML holds.
                    assert isinstance(args["days"], int) and isinstance(args["hourly"], bool), args
        # Streamed, the arguments add up to the whole answer.
        whole = c.chat.completions.create(messages=question, temperature=0, max_tokens=200, **kw)
        whole_calls = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
        streamed = {}
        for chunk in c.chat.completions.create(messages=question, temperature=0, max_tokens=200, stream=True, **kw):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                slot = streamed.setdefault(tc.index, {"name": None, "arguments": ""})
                slot["name"] = slot["name"] or tc.function.name
                slot["arguments"] += tc.function.arguments or ""
        assert [(v["name"], v["arguments"]) for v in streamed.values()] == whole_calls
        # The call goes back through the template (as XML) with its result, and the model answers.
        messages = question + [whole.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": whole.choices[0].message.tool_calls[0].id,
                                "content": json.dumps({"forecast": "sunny"})}]
        r = c.chat.completions.create(model=QWEN_NAME, messages=messages, tools=tools, temperature=0, max_tokens=30)
        assert r.choices[0].message.content or r.choices[0].message.tool_calls
    finally:
        assert s.stop() == 0
