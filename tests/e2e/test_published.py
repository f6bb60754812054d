"""`kylin serve` on published quantized checkpoints (issue 13), with the official openai client
on loopback: the tiny fixtures of tests/fixtures/quantized (compressed-tensors W4A16 and
W8A16, GPTQ, compressed-tensors W8A8), served as they are.

With `--precision f32` the served greedy answer is transformers' (the ids of the reference's
`greedy_new_ids`, up to the first end-of-sequence id); on the default path (integer kernels)
the server answers every request in full. (The FP8 fixtures' f32 follows transformers' FP8
rounding of every layer input, and with it transformers' answers only up to the first input
value the two f32 computations round to different sides: see
crates/kylin-engine/tests/published.rs. The W8A8 fixture's greedy answers are transformers'.)
The fixtures' vocabulary is the words `w0`..`w511`, so a completion's text spells its ids.
"""

import json
import re
from pathlib import Path

import pytest

from test_openai_server import NAME, Server

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quantized"
EOS = 1


def reference(name):
    return json.loads((FIXTURES / "reference" / f"{name}.json").read_text())


def ids_of(text):
    return [int(m) for m in re.findall(r"w(\d+)", text)]


@pytest.mark.parametrize("name", ["tiny-qwen3-w4a16", "tiny-llama-gptq", "tiny-qwen3-w8a16", "tiny-llama-w8a8"])
def test_served_answers_equal_transformers_in_f32_and_complete_on_the_fast_path(name):
    cases = reference(name)["cases"]
    for precision in ["f32", "auto"]:
        server = Server("--precision", precision, model=FIXTURES / name, ctx=512)
        try:
            client = server.client()
            assert [m.id for m in client.models.list().data] == [NAME]
            for case in cases:
                want = case["greedy_new_ids"]
                if EOS in want:
                    want = want[: want.index(EOS)]
                if not want:
                    continue
                r = client.completions.create(
                    model=NAME, prompt=case["input_ids"], max_tokens=len(want), temperature=0
                )
                got = ids_of(r.choices[0].text)
                assert r.usage.prompt_tokens == len(case["input_ids"])
                if precision == "f32":
                    assert got == want, f"{name}: served {got}, transformers {want}"
                else:
                    assert len(got) == len(want) and r.choices[0].finish_reason == "length", r
        finally:
            assert server.stop() == 0, f"{name}: kylin serve did not exit cleanly"
