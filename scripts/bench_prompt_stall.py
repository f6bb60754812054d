#!/usr/bin/env python3
"""How long one client's huge prompt stalls another client's stream on `kylin serve`.

Starts `kylin serve MODEL`, streams a long greedy generation (client A), and while it runs,
client B sends a completion whose prompt is TEXT_MB megabytes of real text (far past the
context: the server answers 400 `CONTEXT_OVERFLOW` once the prompt is tokenized). Prints the
gaps between A's streamed tokens: the median, and the longest, which is the stall B caused
when the prompt is tokenized on the engine thread.

    KYLIN_BIN=target/release/kylin python3 scripts/bench_prompt_stall.py MODEL [--mb 4]

Not part of CI (it measures time).
"""

import argparse
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of prompt client B sends")
    parser.add_argument("--tokens", type=int, default=200, help="tokens client A streams")
    args = parser.parse_args()
    kylin = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
    port = free_port()
    server = subprocess.Popen(
        [kylin, "serve", args.model, "--port", str(port), "--max-body-bytes", str(64 << 20)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            sys.exit("the server did not become ready")
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        text = (ROOT / "testdata/data/gpl-3.0.txt").read_text()
        prompt = (text * (int(args.mb * (1 << 20)) // len(text) + 1))[: int(args.mb * (1 << 20))]
        arrivals = []
        b_result = {}

        def client_b():
            time.sleep(1.0)
            start = time.monotonic()
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 1},
                timeout=600,
            )
            b_result["status"] = r.status_code
            b_result["seconds"] = time.monotonic() - start
            b_result["at"] = start

        b = threading.Thread(target=client_b)
        body = {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": args.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                sys.exit(f"client A's stream answered {r.status_code}: {r.read().decode()}")
            b.start()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(time.monotonic())
        b.join()
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        print(
            f"client A: {len(arrivals)} chunks, median gap {statistics.median(gaps) * 1e3:.1f} ms, "
            f"longest gap {max(gaps) * 1e3:.1f} ms"
        )
        print(f"client B: {args.mb} MB prompt answered {b_result.get('status')} in {b_result.get('seconds', 0):.2f} s")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
