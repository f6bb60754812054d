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
            # The first chunk (the role, empty content) comes when the request is accepted.
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.monotonic())
    return times, usage


class Server:
    """`kylin serve MODEL` on a free port, until closed (a fresh one per measurement: the engine
    keeps the encodings of the latest images, so a second look at an image would not encode it)."""

    def __init__(self, model, threads, extra):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(tempfile.gettempdir()) / f"kylin-bench-vision-{self.port}.log", "w")
        binary = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
        self.proc = subprocess.Popen([binary, "serve", model, "--port", str(self.port), "--threads", str(threads),
                                      "--ctx-size", "8192", *extra], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"kylin serve exited; see {self.log.name}")
            time.sleep(0.5)
        # Warm up: the language model's weights are read once before anything is timed.
        ask(self.base, TEXT, 8)

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)


TEXT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("images", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch-tokens", type=int, default=None)
    a = p.parse_args()
    extra = [] if a.max_batch_tokens is None else ["--max-batch-tokens", str(a.max_batch_tokens)]
    print("| image | prompt tokens | time to first token, alone | stream gap: median before | longest while the image is taken in |")
    print("|---|---:|---:|---:|---:|")
    for path in a.images:
        server = Server(a.model, a.threads, extra)
        try:
            sent = time.monotonic()
            times, usage = ask(server.base, image_message(path), 1)
            ttft = times[0] - sent
        finally:
            server.close()
        server = Server(a.model, a.threads, extra)
        try:
            # The stream, and the image request after its 20th token.
            times = []
            stream = threading.Thread(target=ask, args=(server.base, TEXT, 200, times))
            stream.start()
            while len(times) < 20 and stream.is_alive():
                time.sleep(0.005)
            image_sent = time.monotonic()
            ask(server.base, image_message(path), 1)
            stream.join()
        finally:
            server.close()
        gaps = [b - t for t, b in zip(times, times[1:])]
        before = [g for t, g in zip(times, gaps) if t < image_sent]
        during = [g for t, g in zip(times, gaps) if t + g >= image_sent]
        tokens = usage["prompt_tokens"] if usage else "?"
        print(f"| {Path(path).name} | {tokens} | {ttft * 1e3:.0f} ms | {statistics.median(before) * 1e3:.0f} ms | "
              f"{max(during) * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
