#!/usr/bin/env python3
"""Images on a real-shaped model: the vision tower's time per image, and how long a stream of
another request stalls while an image is encoded.

`kylin serve` runs MODEL (a Qwen3.5 vision-language directory: scripts/make_vision_bench_model.py
writes the 0.8B-shaped one). For each image: a chat asking about it, alone, gives the time to its
first token (the image's decoding and patches, the tower, the prompt's prefill). Then a text
request streams (greedy, 200 tokens) and, once it has given 20 tokens, the same image request
arrives: the stream's gaps between tokens before the image and while it is taken in are the
decode gap the image costs the other request.

Usage:
  python3 scripts/bench_vision.py MODEL IMAGE... [--threads 2]
Prints one line per image (the figures BENCHMARKS.md quotes).
"""

import argparse
import base64
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_message(path):
    data = base64.b64encode(Path(path).read_bytes()).decode()
    mime = {".png": "image/png", ".webp": "image/webp"}.get(Path(path).suffix.lower(), "image/jpeg")
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}},
                                         {"type": "text", "text": "Describe this image."}]}]


def ask(base, messages, max_tokens, times=None):
    """Streams a greedy chat; returns (arrival times of the tokens, appended to `times` as they
    come, and the usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times, usage = ([] if times is None else times), None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                times.append(time.monotonic())
    return times, usage


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("images", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(Path(tempfile.gettempdir()) / f"kylin-bench-vision-{port}.log", "w")
    binary = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
    proc = subprocess.Popen([binary, "serve", a.model, "--port", str(port), "--threads", str(a.threads),
                             "--ctx-size", "8192"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                sys.exit(f"kylin serve exited; see {log.name}")
            time.sleep(0.5)
        text = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        ask(base, text, 8)  # Warm up.
        print("| image | image tokens | time to first token, alone | stream gap: median before | longest while the image is taken in |")
        print("|---|---:|---:|---:|---:|")
        for path in a.images:
            sent = time.monotonic()
            times, usage = ask(base, image_message(path), 1)
            ttft = times[0] - sent
            # The stream, and the image request after its 20th token.
            times = []
            stream = threading.Thread(target=ask, args=(base, text, 200, times))
            stream.start()
            while len(times) < 20 and stream.is_alive():
                time.sleep(0.005)
            image_sent = time.monotonic()
            ask(base, image_message(path), 1)
            stream.join()
            gaps = [b - t for t, b in zip(times, times[1:])]
            before = [g for t, g in zip(times, gaps) if t < image_sent]
            during = [g for t, g in zip(times, gaps) if t + g >= image_sent]
            tokens = usage["prompt_tokens"] if usage else "?"
            print(f"| {Path(path).name} | {tokens} | {ttft * 1e3:.0f} ms | {statistics.median(before) * 1e3:.0f} ms | "
                  f"{max(during) * 1e3:.0f} ms |", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
