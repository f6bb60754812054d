"""Load benchmark of `kylin serve`: throughput, time to first token and inter-token latency at
several concurrencies, for one or more models, in one run.

    .venv/bin/python scripts/loadbench.py MODEL [MODEL ...] [--concurrency 1 4 8 16]
        [--prompt-tokens 128] [--output-tokens 32] [--requests-per-client 2] [--json OUT.json]

For each model it starts `kylin serve` on a free 127.0.0.1 port, waits for /health, sends one
warm-up request, then for each concurrency C runs C closed-loop clients (each sends its next
request when the previous one ends) until C * requests-per-client requests are done. Requests
are streamed completions with a fixed synthetic prompt of about --prompt-tokens tokens (distinct
per request, so no prefix is shared beyond the first words), greedy, exactly --output-tokens
tokens (ignore_eos). TTFT is measured from sending to the first streamed text chunk; the
inter-token latency of a request is (last chunk - first chunk) / (tokens - 1), from the token
count the usage chunk reports. Percentiles are nearest-rank over requests.

This is our own small script rather than aiperf, guidellm or inference-perf: those fetch a
tokenizer (and for some, data sets) from the Hugging Face hub by model name, which the test
machines cannot reach; the quantities measured here are the same ones they report.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(binary, model, extra):
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"kylin-loadbench-{port}.log", "w")
    proc = subprocess.Popen([binary, "serve", model, "--port", str(port), "--served-model-name", "m",
                             "--max-queue", "64", *extra], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"kylin serve exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("kylin serve was not ready within 300 s")


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def prompt(i, n_tokens):
    # About one token per word for these words; distinct per request from the second word on.
    words = [f"Request {i}:"] + [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_tokens - 3)]
    return " ".join(words)


def one(client, i, args):
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    stream = client.completions.create(model="m", prompt=prompt(i, args.prompt_tokens), max_tokens=args.output_tokens,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            last = now
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    itl = (last - first) / (tokens - 1) if tokens > 1 and first else None
    return {"ttft": (first or time.perf_counter()) - t0, "itl": itl, "tokens": tokens, "latency": time.perf_counter() - t0}


def level(port, concurrency, args):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    total = concurrency * args.requests_per_client
    counter = iter(range(total))
    lock = threading.Lock()
    results = []

    def worker():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one(client, 1000 * concurrency + i, args)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def pct(values, p):
        values = sorted(v for v in values if v is not None)
        return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))] if values else None

    ttft = [r["ttft"] for r in results]
    itl = [r["itl"] for r in results]
    return {
        "concurrency": concurrency, "requests": len(results), "wall_s": wall,
        "output_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "requests_per_s": len(results) / wall,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--bin", default=str(Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "kylin"))
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for kylin serve (repeatable)")
    args = ap.parse_args()
    out = []
    for model in args.models:
        proc, port = start(args.bin, model, args.serve_arg)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            client.completions.create(model="m", prompt="warm up", max_tokens=4)
            for c in args.concurrency:
                r = level(port, c, args)
                r["model"] = model
                out.append(r)
                print(f"{Path(model).name:40} c={c:<3} {r['output_tok_per_s']:7.1f} tok/s  "
                      f"TTFT p50 {r['ttft_p50_ms']:8.0f} ms p99 {r['ttft_p99_ms']:8.0f} ms  "
                      f"ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms", flush=True)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
