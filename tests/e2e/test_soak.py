"""Soak test of `kylin serve` (issue 15): for SOAK_SECONDS (default 60; CI runs the default,
longer runs are by hand, e.g. `SOAK_SECONDS=1800`), eight client threads send a seeded mix of
valid, malformed, oversized, unauthorised, too-long, cancelled and concurrent requests on
loopback. Every valid request must get the answer it gets alone (greedy), every bad one its
4xx with an OpenAI-shaped error, resident memory must stay within 5% of its level after the
warm-up, and at the end nothing may run or wait and every KV block must be free.

The figures (requests per kind, throughput, memory) are printed and, with SOAK_REPORT=PATH,
written as JSON; docs/fuzzing.md quotes them.
"""

import json
import os
import random
import threading
import time

# `server` is that module's fixture (a fresh `kylin serve` for this module, stopped with
# SIGTERM at the end, which must exit 0).
from test_openai_server import KEY, NAME, http, server, stream_lines  # noqa: F401

SECONDS = float(os.environ.get("SOAK_SECONDS", "60"))
THREADS = 8
MAX_BODY = 65536
CTX = 2048

PROMPTS = [
    "Name a colour.",
    "What is 2 + 2?",
    "Say hello in French.",
    "Give one word that rhymes with cat.",
    "Name a planet.",
    "What is the opposite of hot?",
]


def chat_body(text, **kw):
    body = {"model": NAME, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 12}
    body.update(kw)
    return body


def error_of(text):
    """The OpenAI-shaped error object of a 4xx body."""
    err = json.loads(text)["error"]
    assert isinstance(err["message"], str) and err["message"], text
    assert isinstance(err["type"], str), text
    return err


def test_soak(server):
    client = server.client()
    # The answers each prompt gets alone, with and without streaming.
    expected = {}
    for p in PROMPTS:
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                           temperature=0, max_tokens=12)
        expected[p] = r.choices[0].message.content
        assert expected[p]

    counts = {}
    failures = []
    lock = threading.Lock()

    def record(kind, problem=None):
        with lock:
            counts[kind] = counts.get(kind, 0) + 1
            if problem is not None and len(failures) < 20:
                failures.append(f"{kind}: {problem}")

    def valid_chat(rng):
        p = rng.choice(PROMPTS)
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                           temperature=0, max_tokens=12)
        got = r.choices[0].message.content
        record("valid chat", None if got == expected[p] else f"{got!r} != {expected[p]!r}")

    def valid_stream(rng):
        p = rng.choice(PROMPTS)
        text = ""
        for chunk in client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}],
                                                    temperature=0, max_tokens=12, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        record("valid stream", None if text == expected[p] else f"{text!r} != {expected[p]!r}")

    def expect_status(kind, status, body, key=KEY, path="/v1/chat/completions"):
        got, _, text = http(server.base, "POST", path, body=body, key=key)
        problem = None
        if got != status:
            problem = f"status {got}, wanted {status}: {text[:200]}"
        else:
            try:
                error_of(text)
            except Exception as e:  # noqa: BLE001 - any shape problem is a failure
                problem = f"not an OpenAI error: {e}: {text[:200]}"
        record(kind, problem)

    def malformed_json(rng):
        raw = json.dumps(chat_body(rng.choice(PROMPTS))).encode()
        cut = raw[: rng.randrange(1, len(raw) - 1)]
        expect_status("malformed json", 400, cut)

    def wrong_type(rng):
        body = chat_body(rng.choice(PROMPTS))
        field, value = rng.choice([("max_tokens", "twelve"), ("temperature", "hot"), ("messages", 7),
                                   ("n", -1), ("top_p", 3.5)])
        body[field] = value
        expect_status("invalid field", 400, body)

    def oversized(rng):
        body = chat_body("x" * (MAX_BODY + rng.randrange(1, 4096)))
        expect_status("oversized body", 413, body)

    def unknown_model(rng):
        expect_status("unknown model", 404, dict(chat_body(rng.choice(PROMPTS)), model="gpt-4"))

    def bad_key(rng):
        expect_status("bad key", 401, chat_body(rng.choice(PROMPTS)), key="wrong-key")

    def too_long(rng):
        # Token ids past the context: a 400 naming the lengths, never a queued request.
        body = {"model": NAME, "prompt": [rng.randrange(10, 1000) for _ in range(CTX + 10)], "max_tokens": 4}
        expect_status("prompt too long", 400, body, path="/v1/completions")

    def cancelled(rng):
        body = {"model": NAME, "prompt": rng.choice(PROMPTS), "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        lines = stream_lines(server.base, "/v1/completions", body)
        received, wanted = 0, rng.randrange(1, 6)
        for line in lines:
            received += line.startswith("data: ")
            if received >= wanted:
                break
        lines.close()
        record("cancelled stream")

    actions = [(valid_chat, 6), (valid_stream, 4), (malformed_json, 2), (wrong_type, 2), (oversized, 1),
               (unknown_model, 1), (bad_key, 1), (too_long, 1), (cancelled, 2)]
    population = [a for a, w in actions for _ in range(w)]

    start = time.time()
    warm_until = start + min(15.0, SECONDS / 4)
    deadline = start + SECONDS
    rss = {"warm": None, "peak_after_warm": 0, "samples": 0}

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < deadline:
            action = rng.choice(population)
            try:
                action(rng)
            except Exception as e:  # noqa: BLE001 - every unexpected exception is a failure
                record(f"{action.__name__} raised", f"{type(e).__name__}: {e}")

    def sampler():
        while time.time() < deadline:
            now = time.time()
            value = server.rss_kib()
            if now >= warm_until:
                if rss["warm"] is None:
                    rss["warm"] = value
                rss["peak_after_warm"] = max(rss["peak_after_warm"], value)
                rss["samples"] += 1
            time.sleep(0.5)

    threads = [threading.Thread(target=worker, args=(1000 + i,)) for i in range(THREADS)]
    threads.append(threading.Thread(target=sampler))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 300)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    elapsed = time.time() - start

    # Everything drained: nothing runs or waits, every block is free.
    deadline_drain = time.time() + 30
    m = server.metrics()
    while time.time() < deadline_drain and (m["kylin:num_requests_running"] or m["kylin:num_requests_waiting"]
                                            or m["kylin:kv_cache_blocks_used"]):
        time.sleep(0.1)
        m = server.metrics()
    rss_end = server.rss_kib()

    total = sum(counts.values())
    report = {
        "seconds": round(elapsed, 1),
        "requests": total,
        "requests_per_second": round(total / elapsed, 1),
        "by_kind": dict(sorted(counts.items())),
        "rss_kib_after_warmup": rss["warm"],
        "rss_kib_peak_after_warmup": rss["peak_after_warm"],
        "rss_kib_end": rss_end,
        "rss_samples": rss["samples"],
        "running_end": m["kylin:num_requests_running"],
        "waiting_end": m["kylin:num_requests_waiting"],
        "kv_blocks_used_end": m["kylin:kv_cache_blocks_used"],
        "failures": failures,
    }
    print("soak:", json.dumps(report, indent=1))
    if os.environ.get("SOAK_REPORT"):
        with open(os.environ["SOAK_REPORT"], "w") as f:
            json.dump(report, f, indent=1)

    assert not failures, failures
    for kind in ["valid chat", "valid stream", "malformed json", "invalid field", "oversized body",
                 "unknown model", "bad key", "prompt too long", "cancelled stream"]:
        assert counts.get(kind, 0) > 0, f"no '{kind}' request was sent in {SECONDS} s"
    assert m["kylin:num_requests_running"] == 0
    assert m["kylin:num_requests_waiting"] == 0
    assert m["kylin:kv_cache_blocks_used"] == 0
    assert rss["warm"] is not None and rss["samples"] > 0
    assert rss["peak_after_warm"] <= rss["warm"] * 1.05, (rss["warm"], rss["peak_after_warm"])
    assert rss_end <= rss["warm"] * 1.05, (rss["warm"], rss_end)
