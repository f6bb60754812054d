"""End to end: three `kylin serve` replicas behind HAProxy with the recipe of
deploy/haproxy/kylin.cfg, on loopback.

A shared-prefix workload (sessions that each repeat one long system prompt) runs through the
balancer with prefix-affine routing and with round-robin; the replicas' own /metrics give the
prefix-cache hit rate of each, and the client measures the time to the first token. Then a
replica is killed (SIGKILL) while requests run: only requests it was running may fail, and
everything after goes to the others. The figures are printed (`pytest -s`) for BENCHMARKS.md.
"""

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from test_retrieval import MODELS, ROOT, free_port, kylin_bin

# Debian puts it in /usr/sbin, which a user's PATH may not hold.
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
SESSIONS = 4
TURNS = 6
SYSTEM = ("You are the assistant of session {s} ({policy}). Answer in one short sentence, plainly, "
          "without lists. Facts you may use: the project is an inference engine written in Rust; it "
          "loads Hugging Face directories as published, with no conversion step; it serves an "
          "OpenAI-compatible API; it batches many sequences in one step over a paged KV cache whose "
          "full blocks are kept as a prefix cache, so a repeated system prompt is computed once per "
          "replica. Session {s} is about topic number {s}.")


def wait_ready(base, proc, log, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited; see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{base} was not ready in {seconds} s")


class Cluster:
    def __init__(self):
        model = MODELS / "smollm2-135m-instruct"
        if not (model / "config.json").is_file():
            pytest.fail(f"{model} is missing; run scripts/setup.sh")
        self.procs, self.ports = [], []
        logs = Path(tempfile.gettempdir())
        for i in range(3):
            port = free_port()
            log = logs / f"kylin-replica-{port}.log"
            proc = subprocess.Popen(
                [kylin_bin(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
                 "--served-model-name", "smol", "--ctx-size", "1024", "--max-seqs", "4", "--threads", "1"],
                stdout=open(log, "w"), stderr=subprocess.STDOUT)
            self.procs.append(proc)
            self.ports.append(port)
        for proc, port in zip(self.procs, self.ports):
            wait_ready(f"http://127.0.0.1:{port}", proc, logs / f"kylin-replica-{port}.log")
        self.lb_port = free_port()
        self.base = f"http://127.0.0.1:{self.lb_port}"
        env = dict(os.environ, KYLIN_LB_BIND=f"127.0.0.1:{self.lb_port}",
                   **{f"KYLIN_REPLICA_{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(self.ports)})
        self.lb = {}
        for policy in ("prefix", "roundrobin"):
            port = free_port()
            env_policy = dict(env, KYLIN_LB_BIND=f"127.0.0.1:{port}", KYLIN_LB_POLICY=policy)
            log = logs / f"haproxy-{port}.log"
            proc = subprocess.Popen([HAPROXY, "-db", "-f", str(ROOT / "deploy/haproxy/kylin.cfg")],
                                    env=env_policy, stdout=open(log, "w"), stderr=subprocess.STDOUT)
            self.lb[policy] = (f"http://127.0.0.1:{port}", proc)
            wait_ready(f"http://127.0.0.1:{port}", proc, log, seconds=30)

    def counters(self):
        """Sum over live replicas of the prefix cache's hit and query counters."""
        hits = queries = 0
        for proc, port in zip(self.procs, self.ports):
            if proc.poll() is not None:
                continue
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            hits += float(re.search(r"^kylin:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M).group(1))
            queries += float(re.search(r"^kylin:prefix_cache_queries_total\{[^}]*\} (\S+)", text, re.M).group(1))
        return hits, queries

    def stop(self):
        for _, proc in self.lb.values():
            proc.terminate()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs + [p for _, p in self.lb.values()]:
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    yield c
    c.stop()


def ask(base, session, turn, policy):
    """One chat turn of `session` with max_tokens 1: its latency is the time to the first token."""
    body = {"model": "smol", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM.format(s=session, policy=policy)},
                         {"role": "user", "content": f"Question {turn}: what is {turn} plus {session}?"}]}
    started = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    return r.status_code, time.perf_counter() - started


def run_workload(cluster, policy):
    base, _ = cluster.lb[policy]
    before = cluster.counters()
    latencies = []
    for turn in range(TURNS):
        for session in range(SESSIONS):
            status, seconds = ask(base, session, turn, policy)
            assert status == 200
            latencies.append(seconds)
    after = cluster.counters()
    hit_rate = (after[0] - before[0]) / max(after[1] - before[1], 1)
    return hit_rate, sum(latencies) / len(latencies)


def test_prefix_affine_routing_beats_round_robin_on_shared_prefixes(cluster):
    affine_hits, affine_ttft = run_workload(cluster, "prefix")
    rr_hits, rr_ttft = run_workload(cluster, "roundrobin")
    print(f"\nprefix-affine: prefix-cache hit rate {affine_hits:.3f}, mean time to first token {affine_ttft * 1e3:.1f} ms")
    print(f"round-robin:   prefix-cache hit rate {rr_hits:.3f}, mean time to first token {rr_ttft * 1e3:.1f} ms")
    # Affine: each session's prompt is computed once in all (on its replica); round-robin: once
    # per replica it lands on.
    assert affine_hits > rr_hits + 0.1, (affine_hits, rr_hits)


def test_a_killed_replica_loses_only_its_in_flight_requests(cluster):
    base, _ = cluster.lb["prefix"]
    results = []

    def turn(i):
        return ask(base, i % SESSIONS, 100 + i, "failover")[0]

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(turn, i) for i in range(8)]
        time.sleep(0.3)
        cluster.procs[0].send_signal(signal.SIGKILL)
        cluster.procs[0].wait(timeout=10)
        futures += [pool.submit(turn, i) for i in range(8, 24)]
        results = [f.result() for f in futures]
    failed = [s for s in results if s != 200]
    print(f"\nfailover: {len(results)} requests, {len(failed)} failed (statuses {sorted(set(results))})")
    # At most the two requests that were running on the killed replica.
    assert len(failed) <= 2, results
    # Once HAProxy has marked it down, every request succeeds on the other two.
    time.sleep(2.5)
    statuses = [ask(base, s, 200 + s, "after")[0] for s in range(SESSIONS * 2)]
    assert statuses == [200] * len(statuses)
