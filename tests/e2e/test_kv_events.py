"""End to end: `kylin serve --kv-events-endpoint` publishes the prefix cache's changes as
vLLM's KV-cache events, read here as a precise prefix router reads vLLM's: a ZeroMQ SUB socket
and msgspec decoding with vLLM's own event types.

SmolLM2 with a KV cache of a few blocks: a prompt's full blocks are announced (`BlockStored`,
each block's token ids, chained by `parent_block_hash`), and when later prompts need the room,
the cached blocks they evict are announced (`BlockRemoved` with the same hashes).
"""

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from test_balancer import wait_ready
from test_retrieval import MODELS, free_port, kylin_bin

BLOCK = 16
TOPIC = b"kylin-kv"


# The types of vllm/distributed/kv_events.py, as vLLM's examples/online_serving/
# kv_events_subscriber.py declares them for its subscribers.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@pytest.fixture(scope="module")
def server():
    model = MODELS / "smollm2-135m-instruct"
    if not (model / "config.json").is_file():
        pytest.fail(f"{model} is missing; run scripts/setup.sh")
    port, events_port = free_port(), free_port()
    log = Path(tempfile.gettempdir()) / f"kylin-kv-events-{port}.log"
    # About 22 blocks of 16 positions: three prompts of 160 tokens cannot all stay cached.
    proc = subprocess.Popen(
        [kylin_bin(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
         "--ctx-size", "256", "--max-seqs", "1", "--kv-memory", "16MiB", "--kv-block-size", str(BLOCK),
         "--kv-dtype", "f32", "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
         "--kv-events-topic", TOPIC.decode()],
        stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log)
        assert "KV-cache events (vLLM's format) published on" in log.read_text()
        yield base, f"tcp://127.0.0.1:{events_port}"
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


class Follower:
    """What a prefix router keeps: the messages, their sequence numbers and the decoded events."""

    def __init__(self, endpoint):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sequences, self.events = [], []
        time.sleep(0.5)  # a SUB socket sees only what is published after it joined

    def read_until(self, done, seconds=30):
        deadline = time.time() + seconds
        while not done() and time.time() < deadline:
            if self.socket.poll(200):
                topic, sequence, payload = self.socket.recv_multipart()
                assert topic == TOPIC
                self.sequences.append(int.from_bytes(sequence, "big"))
                batch = self.decoder.decode(payload)
                assert abs(batch.ts - time.time()) < 60
                self.events.extend(batch.events)
        assert done(), f"not seen in {seconds} s; events so far: {self.events}"

    def stored(self):
        return [e for e in self.events if isinstance(e, BlockStored)]

    def removed(self):
        return {h for e in self.events if isinstance(e, BlockRemoved) for h in e.block_hashes}

    def close(self):
        self.socket.close(0)
        self.context.term()


def complete(base, ids):
    r = httpx.post(base + "/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": ids,
                                                   "max_tokens": 1, "temperature": 0}, timeout=120)
    r.raise_for_status()


def test_stored_blocks_carry_their_tokens_chained_and_evictions_name_them(server):
    base, endpoint = server
    follower = Follower(endpoint)
    try:
        prompt = list(range(1000, 1040))
        complete(base, prompt)
        # 40 prompt tokens and one generated: two full blocks, announced in order.
        follower.read_until(lambda: len(follower.stored()) >= 2)
        first, second = follower.stored()[:2]
        assert first.token_ids == prompt[:BLOCK] and second.token_ids == prompt[BLOCK:2 * BLOCK]
        assert first.block_size == BLOCK and second.block_size == BLOCK
        assert first.parent_block_hash is None
        assert second.parent_block_hash == first.block_hashes[0]
        assert len(first.block_hashes) == 1 and first.lora_id is None

        # The same prompt again is a prefix-cache hit: nothing new is stored.
        complete(base, prompt)
        time.sleep(0.5)
        follower.read_until(lambda: True, seconds=1)
        assert len(follower.stored()) == 2

        # Prompts that need the room evict the cached blocks, under the hashes they were stored with.
        for k in range(3):
            complete(base, list(range(2000 + 200 * k, 2160 + 200 * k)))
        follower.read_until(lambda: first.block_hashes[0] in follower.removed())
        stored = {e.block_hashes[0] for e in follower.stored()}
        assert follower.removed() <= stored, "only blocks that were stored are removed"
        assert follower.sequences == list(range(follower.sequences[0], follower.sequences[0] + len(follower.sequences)))
    finally:
        follower.close()


def test_a_busy_endpoint_is_a_clear_startup_error(server):
    _, endpoint = server
    model = MODELS / "smollm2-135m-instruct"
    out = subprocess.run([kylin_bin(), "serve", str(model), "--port", "0", "--kv-events-endpoint", endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.startswith("[INPUT_INVALID]") and "--kv-events-endpoint" in out.stderr, out.stderr
