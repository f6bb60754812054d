#!/usr/bin/env python3
"""Speculative decoding, Kylin against llama.cpp: decode speed with and without it, same model, same prompts.

Four servers run the same model: `kylin serve` from its Hugging Face directory without and with
`--speculative-tokens K` (n-gram prompt lookup), and `llama-server` from its GGUF twin without and
with llama.cpp's own draftless speculative decoding, its draft length set to K as well:
`--spec-type ngram-mod --spec-ngram-mod-n-match 16 --spec-ngram-mod-n-min 1 --spec-ngram-mod-n-max K`
by default (`--llama-spec-type`, `--llama-ngram-n` choose another). Of llama.cpp's draftless types
(ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache) it was the fastest in a short
trial on this machine: on code edits nearly all its drafts are accepted (ngram-simple and the maps
draft more and lose more), and on chat and JSON extraction it drafts nothing, so it costs nothing
there (the others' drafts there are mostly rejected and slow decoding down). Its n-gram pool is
shared by all requests of a server, as llama.cpp runs it.

All four are loaded before anything is measured and only one generates at a time. Each prompt goes
to all four, the order rotating from prompt to prompt, streamed with greedy decoding; the decode
rate is the generated tokens after the first divided by the time from the first token to the last
(the tokens are the `usage` of the stream's last chunk, which both servers send with
`stream_options.include_usage`). Both engines run with the same threads, a 4096-token context and
one sequence (`--max-seqs 1` / `-np 1`); llama-server with flash attention on (`-fa on`).

Greedy decoding makes each engine's two outputs comparable: Kylin's with and without speculation
must be identical, and so should llama.cpp's (a difference is reported, and the script exits with
status 1 at the end if Kylin's differ). llama.cpp's may not be: its verification batch runs other
kernels than one-token decoding, and where two logits nearly tie the greedy choice can flip (seen
on `chat` with ngram-simple and ngram-cache, even when no draft token was accepted). The two
engines' outputs are not compared with each other (different weights: Kylin quantizes the
safetensors itself, llama.cpp reads the published GGUF).

The prompt sets are bench_speculative.py's (`edit`, `chat`, `extract`; see its docstring).

The llama.cpp vendored by the llama-cpp-sys-2 crate ships without tools/server, so llama-server
comes from a full llama.cpp tree (e.g. the one vendored by llama-cpp-python's sdist), built with
  cmake -S LLAMA_CPP -B BUILD -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  cmake --build BUILD --target llama-server -j2
and given with `--llama-server BUILD/bin/llama-server` (or the LLAMA_SERVER environment variable).

Usage:
  python3 scripts/bench_speculative_vs_llamacpp.py HF_DIR MODEL.gguf [--speculative-tokens 8]
      [--quantize q4_k] [--threads 2] [--set edit,chat,extract] [--max-tokens 1400]
      [--llama-server PATH] [--llama-spec-type ngram-mod] [--llama-ngram-n 16]
e.g.
  python3 scripts/bench_speculative_vs_llamacpp.py ~/.cache/kylin-models/qwen2.5-coder-0.5b-instruct \\
      ~/.cache/kylin-models/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --quantize q4_k
Prints one line per prompt and server and a summary per set.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LABELS = ["kylin", "kylin+spec", "llama", "llama+spec"]
# Draftless speculative types of llama-server, and how K and the lookup length map onto their options.
LLAMA_SPEC_TYPES = {
    # the m tokens after the last earlier occurrence of the last n tokens
    "ngram-simple": lambda k, n: ["--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(k)],
    # the same from a hash map of the context's n-grams
    "ngram-map-k": lambda k, n: ["--spec-ngram-map-k-size-n", str(n), "--spec-ngram-map-k-size-m", str(k)],
    # up to four m-grams per key, the most frequent drafted
    "ngram-map-k4v": lambda k, n: ["--spec-ngram-map-k4v-size-n", str(n), "--spec-ngram-map-k4v-size-m", str(k)],
    # rolling hash of the last n tokens to the next token, a pool shared across requests
    "ngram-mod": lambda k, n: ["--spec-ngram-mod-n-match", str(n), "--spec-ngram-mod-n-min", "1",
                               "--spec-ngram-mod-n-max", str(k)],
    # llama-lookup's three-level n-gram cache; its draft length is fixed at 8 in this llama.cpp
    "ngram-cache": lambda k, n: [],
}


def launch(cmd, name):
    port = bs.free_port()
    log = Path(tempfile.gettempdir()) / f"kylin-bench-vs-llamacpp-{name.replace('+', '-')}-{port}.log"
    cmd = [c.replace("{port}", str(port)) for c in cmd]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def metric(base, suffix):
    """A counter of a server's Prometheus /metrics whose name ends with `suffix` (any prefix)."""
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(suffix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", help="Hugging Face model directory (Kylin)")
    ap.add_argument("gguf", help="the same model as a GGUF file (llama.cpp)")
    ap.add_argument("--speculative-tokens", type=int, default=8,
                    help="Kylin's --speculative-tokens, and llama.cpp's draft length")
    ap.add_argument("--quantize", help="Kylin's --quantize (e.g. q4_k against a Q4_K_M GGUF)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--set", default="edit,chat,extract")
    ap.add_argument("--max-tokens", type=int, default=1400)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "/tmp/lcpp-spec-build/bin/llama-server"))
    ap.add_argument("--llama-spec-type", default="ngram-mod", choices=sorted(LLAMA_SPEC_TYPES))
    ap.add_argument("--llama-ngram-n", type=int,
                    help="llama.cpp's lookup n-gram length: ngram-mod's n-match (default 16, the least it "
                         "recommends), the ngram-simple/-map size-n (default 6)")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments, space-separated")
    args = ap.parse_args()

    k = args.speculative_tokens
    if args.llama_ngram_n is None:
        args.llama_ngram_n = 16 if args.llama_spec_type == "ngram-mod" else 6
    kylin = os.environ.get("KYLIN_BIN", str(ROOT / "target/release/kylin"))
    kylin_common = [kylin, "serve", args.model, "--host", "127.0.0.1", "--port", "{port}",
                    "--served-model-name", "m", "--threads", str(args.threads), "--max-seqs", "1",
                    "--ctx-size", str(args.ctx_size)]
    if args.quantize:
        kylin_common += ["--quantize", args.quantize]
    llama_common = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", "{port}",
                    "--alias", "m", "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx_size),
                    "-np", "1", "-fa", "on", "--metrics", "--no-webui", *args.llama_args.split()]
    llama_spec = ["--spec-type", args.llama_spec_type, *LLAMA_SPEC_TYPES[args.llama_spec_type](k, args.llama_ngram_n)]
    cmds = {
        "kylin": kylin_common,
        "kylin+spec": kylin_common + ["--speculative-tokens", str(k)],
        "llama": llama_common,
        "llama+spec": llama_common + llama_spec,
    }
    print(f"llama.cpp speculation: {' '.join(llama_spec)}", flush=True)

    # One at a time: all four servers are loaded before anything is measured, and only one runs.
    procs, bases = {}, {}
    try:
        for label in LABELS:
            proc, base, log = launch(cmds[label], label)
            procs[label] = proc
            bs.wait_ready(proc, base, label, log)
            bases[label] = base

        sets = {"edit": [(p, None) for p in bs.edit_prompts()], "chat": [(p, None) for p in bs.CHATS],
                "extract": bs.extract_prompts()}
        kylin_differs = False
        for name in args.set.split(","):
            totals = {label: [0, 0.0] for label in LABELS}
            same = {"kylin": 0, "llama": 0}
            for i, (prompt, response_format) in enumerate(sets[name]):
                order = LABELS[i % 4:] + LABELS[:i % 4]
                outs = {}
                for label in order:
                    text, tokens, seconds = bs.run(bases[label], prompt, args.max_tokens, response_format)
                    outs[label] = text
                    rate = (tokens - 1) / seconds if seconds > 0 and tokens > 1 else 0.0
                    totals[label][0] += max(tokens - 1, 0)
                    totals[label][1] += seconds
                    print(f"{name} #{i} {label:10}: {tokens} tokens, decode {rate:.1f} tok/s", flush=True)
                for engine in ("kylin", "llama"):
                    if outs[engine] == outs[engine + "+spec"]:
                        same[engine] += 1
                    else:
                        print(f"{name} #{i}: {engine}'s outputs with and without speculation DIFFER", flush=True)
                        kylin_differs |= engine == "kylin"
                if response_format:
                    for label in LABELS:
                        try:
                            json.loads(outs[label])
                        except ValueError:
                            print(f"{name} #{i}: {label}'s output is not valid JSON", flush=True)
            rate = {label: totals[label][0] / totals[label][1] if totals[label][1] else 0.0 for label in LABELS}

            def ratio(a, b):
                return f"{a / b:.2f}x" if b else "n/a"

            n = len(sets[name])
            print(f"{name}: kylin {rate['kylin']:.1f} -> {rate['kylin+spec']:.1f} tok/s "
                  f"({ratio(rate['kylin+spec'], rate['kylin'])}, {same['kylin']}/{n} outputs identical); "
                  f"llama.cpp {rate['llama']:.1f} -> {rate['llama+spec']:.1f} tok/s "
                  f"({ratio(rate['llama+spec'], rate['llama'])}, {same['llama']}/{n} outputs identical); "
                  f"kylin/llama.cpp without {ratio(rate['kylin'], rate['llama'])}, "
                  f"with {ratio(rate['kylin+spec'], rate['llama+spec'])}", flush=True)
        for label in ("kylin+spec", "llama+spec"):
            proposed = metric(bases[label], "spec_decode_num_draft_tokens_total")
            accepted = metric(bases[label], "spec_decode_num_accepted_tokens_total")
            share = f" ({accepted / proposed:.1%})" if proposed else ""
            print(f"{label} acceptance: {accepted:.0f} of {proposed:.0f} proposed tokens{share}", flush=True)
        if kylin_differs:
            sys.exit("Kylin's outputs differ; speculative decoding changed the answer")
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
