#!/usr/bin/env python3
"""Speculative decoding on real text: decode speed with and without it, same model, same run.

Two `kylin serve` processes run the same model side by side, one with `--speculative-tokens K`
(n-gram prompt lookup) or `--draft-model DIR`, one without; each prompt goes to one and then
the other (the order alternating from prompt to prompt), streamed with greedy decoding, and the
decode rate is the generated tokens after the first divided by the time from the first token to
the last. Outputs must be identical (the script stops otherwise).

Three prompt sets:
* `edit`: code edits whose answer copies its input: a 100-130-line window of
  testdata/data/python-json-module.py (CPython's json module) with one small change asked for
  (rename, reword a docstring, add a comment), the whole window asked back.
* `chat`: free-form questions whose answers copy nothing.
* `extract`: structured extraction under a JSON schema (`response_format`), whose strings copy
  their input: every function of a window of the same file, with its `def` line as written
  and the first line of its docstring.

Usage:
  python3 scripts/bench_speculative.py MODEL [--speculative-tokens 8] [--draft-model DIR]
      [--quantize q8_0] [--threads 2] [--set edit,chat,extract] [--max-tokens 1400]
Prints one line per prompt and a summary per set (the figures BENCHMARKS.md quotes).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "testdata/data/python-json-module.py"

EDITS = [
    (14, 130, "Rename the constant `FLAGS` to `PARSE_FLAGS` everywhere it appears."),
    (130, 245, "Add the comment `# Fast path for plain strings.` on its own line before the first `while` loop."),
    (245, 370, "Change every single-quoted string literal 'utf-8' to double quotes, and nothing else."),
]
CHATS = [
    "Explain in a few paragraphs why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the trade-offs between a linked list and an array? Answer in prose.",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def edit_prompts():
    lines = SOURCE.read_text().splitlines()
    prompts = []
    for start, end, change in EDITS:
        window = "\n".join(lines[start:end])
        prompts.append(f"{change} Reply with the whole modified code in one ```python block and nothing "
                       f"else.\n\n```python\n{window}\n```")
    return prompts


EXTRACT_WINDOWS = [(14, 130), (130, 245), (245, 370)]

FUNCTIONS_SCHEMA = {
    "type": "object",
    "properties": {
        "functions": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "def_line": {"type": "string"},
                    "docstring_first_line": {"type": "string"},
                },
                "required": ["name", "def_line", "docstring_first_line"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["functions"],
    "additionalProperties": False,
}


def extract_prompts():
    lines = SOURCE.read_text().splitlines()
    prompts = []
    for start, end in EXTRACT_WINDOWS:
        window = "\n".join(lines[start:end])
        prompt = ("List every function and method defined in this code: its name, its `def` line exactly as "
                  "written, and the first line of its docstring exactly as written (empty if it has none)."
                  f"\n\n```python\n{window}\n```")
        prompts.append((prompt, {"type": "json_schema",
                                 "json_schema": {"name": "functions", "schema": FUNCTIONS_SCHEMA}}))
    return prompts


def start(model, extra, common, name):
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"kylin-bench-spec-{name}-{port}.log"
    kylin = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
    proc = subprocess.Popen([kylin, "serve", model, "--host", "127.0.0.1", "--port", str(port),
                             "--served-model-name", "m", *common, *extra],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base, name, log)
    return proc, base


def wait_ready(proc, base, name, log):
    """Waits up to 300 s for `base`/health; exits naming `log` if the server dies or stays down."""
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name} server exited; see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"{name} server not ready; see {log}")


def run(base, prompt, max_tokens, response_format=None):
    """Streams one greedy chat completion: (text, tokens, seconds from first token to last)."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if response_format:
        body["response_format"] = response_format
    text, first, last, tokens = [], None, None, 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    return "".join(text), tokens, (last - first) if first else 0.0


def metric(base, name):
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--speculative-tokens", type=int, default=8)
    ap.add_argument("--draft-model")
    ap.add_argument("--quantize")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--set", default="edit,chat")
    ap.add_argument("--max-tokens", type=int, default=1400)
    args = ap.parse_args()

    common = ["--threads", str(args.threads), "--max-seqs", "1", "--ctx-size", "4096"]
    if args.quantize:
        common += ["--quantize", args.quantize]
    spec = ["--speculative-tokens", str(args.speculative_tokens)]
    if args.draft_model:
        spec += ["--draft-model", args.draft_model]
    # One at a time: both servers are loaded before anything is measured, and only one runs.
    plain_proc, plain = start(args.model, [], common, "plain")
    spec_proc, fast = start(args.model, spec, common, "spec")
    try:
        sets = {"edit": [(p, None) for p in edit_prompts()], "chat": [(p, None) for p in CHATS],
                "extract": extract_prompts()}
        for name in args.set.split(","):
            rates = {"plain": [], "spec": []}
            totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
            for i, (prompt, response_format) in enumerate(sets[name]):
                order = [("plain", plain), ("spec", fast)]
                if i % 2:
                    order.reverse()
                outs = {}
                for label, base in order:
                    text, tokens, seconds = run(base, prompt, args.max_tokens, response_format)
                    outs[label] = text
                    rate = (tokens - 1) / seconds if seconds > 0 else 0.0
                    rates[label].append(rate)
                    totals[label][0] += tokens - 1
                    totals[label][1] += seconds
                    print(f"{name} #{i} {label:5}: {tokens} tokens, decode {rate:.1f} tok/s", flush=True)
                if outs["plain"] != outs["spec"]:
                    sys.exit(f"{name} #{i}: the outputs differ; speculative decoding changed the answer")
                if response_format:
                    json.loads(outs["plain"])
            plain_rate = totals["plain"][0] / totals["plain"][1]
            spec_rate = totals["spec"][0] / totals["spec"][1]
            print(f"{name}: without {plain_rate:.1f} tok/s, with {spec_rate:.1f} tok/s, "
                  f"{spec_rate / plain_rate:.2f}x (all outputs identical)", flush=True)
        proposed = metric(fast, "kylin:spec_decode_num_draft_tokens_total")
        accepted = metric(fast, "kylin:spec_decode_num_accepted_tokens_total")
        if proposed:
            print(f"acceptance: {accepted:.0f} of {proposed:.0f} proposed tokens ({accepted / proposed:.1%})")
    finally:
        for proc in (plain_proc, spec_proc):
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
