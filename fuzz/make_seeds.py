#!/usr/bin/env python3
"""Regenerates the committed seed corpora under fuzz/corpus/ from the shared fixtures and the
cached test models (only small pieces of each: headers, never weights).

Usage: python3 fuzz/make_seeds.py   (from the repository root)
"""
import json
import os
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "testdata"
FIXTURES = SHARED / "fixtures"
MODELS = Path.home() / ".cache" / "kylin-models"
CORPUS = ROOT / "corpus"


def put(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    (d / name).write_bytes(data)


def small_safetensors(header):
    """The same tensor names and dtypes as a real header, each shrunk to shape [2, 2]."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F64": 8}
    out, offset = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            out[name] = entry
            continue
        n = 4 * sizes.get(entry["dtype"], 4)
        out[name] = {"dtype": entry["dtype"], "shape": [2, 2], "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(offset)


def safetensors_seeds():
    files = sorted(FIXTURES.glob("*/model.safetensors"))
    files.append(FIXTURES / "tiny-qwen3-sharded-f32" / "model-00001-of-00017.safetensors")
    for f in files:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            text = fh.read(n)
        header = json.loads(text)
        put("safetensors_header", f"{f.parent.name}-small", small_safetensors(header))
        # The real header with the data cut off: a truncated download.
        put("safetensors_header", f"{f.parent.name}-truncated", struct.pack("<Q", n) + text)


def json_seeds():
    for f in sorted(FIXTURES.glob("*/config.json")) + sorted(MODELS.glob("*/config.json")):
        put("hf_config", f.parent.name, f.read_bytes())
    # quantization_config, as stored-quantized checkpoints write it.
    base = json.loads((FIXTURES / "tiny-qwen3" / "config.json").read_text())
    for q in (
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        {"quant_method": "kylin", "format": "q8_0-packed", "version": 1},
        {"quant_method": "kylin", "format": "q4_k-packed", "version": 1},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
    ):
        put("hf_config", f"quant-{q['quant_method']}-{q.get('format', 'x')}", json.dumps(dict(base, quantization_config=q)))
    for f in sorted(FIXTURES.glob("*/generation_config.json")) + sorted(MODELS.glob("*/generation_config.json")):
        put("generation_config", f.parent.name, f.read_bytes())
    put("shard_index", "tiny-qwen3-sharded-f32", (FIXTURES / "tiny-qwen3-sharded-f32" / "model.safetensors.index.json").read_bytes())
    for f in sorted(FIXTURES.glob("*/tokenizer_config.json")) + sorted(MODELS.glob("*/tokenizer_config.json")):
        put("tokenizer_config", f.parent.name, f.read_bytes())
        cfg = json.loads(f.read_text())
        if isinstance(cfg.get("chat_template"), str):
            put("chat_template", f.parent.name, cfg["chat_template"])
    put("chat_template", "simple", "{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    put("chat_template", "raise", "{% if messages[0].role != 'system' %}{{ raise_exception('no system') }}{% endif %}")
    put("chat_template", "methods", "{{ messages[0].content.split(' ')|tojson(indent=2) }}{{ strftime_now('%Y-%m-%d') }}"
        "{% set ns = namespace(n=0) %}{% for m in messages|reverse %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}")


def gguf_seeds():
    """Each cached GGUF's header with its long arrays (vocabulary, merges) cut to 8 items: the
    metadata and tensor table are real, the tensor data is absent."""
    for f in sorted((MODELS / "gguf").glob("*.gguf")):
        data = open(f, "rb").read(16 << 20)
        pos = 0

        def take(n):
            nonlocal pos
            b = data[pos:pos + n]
            pos += n
            return b

        scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def value(t):
            if t in scalar:
                return take(scalar[t])
            if t == 8:
                n = struct.unpack("<Q", data[pos:pos + 8])[0]
                return take(8 + n)
            if t == 9:
                it, n = struct.unpack("<IQ", take(12))
                items = [value(it) for _ in range(n)]
                return struct.pack("<IQ", it, min(n, 8)) + b"".join(items[:8])
            raise ValueError(t)

        out = take(4) + take(4)
        tensors, kvs = struct.unpack("<QQ", data[pos:pos + 16])
        out += take(16)
        for _ in range(kvs):
            key = value(8)
            t = struct.unpack("<I", take(4))[0]
            out += key + struct.pack("<I", t) + value(t)
        for _ in range(tensors):
            name = value(8)
            nd = struct.unpack("<I", take(4))[0]
            out += name + struct.pack("<I", nd) + take(8 * nd + 4 + 8)
        out += bytes(-len(out) % 32)
        put("gguf_header", f.stem, out)
        put("gguf_header", f.stem + "-first-4k", data[:4096])


def server_seeds():
    bodies = {
        "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        "chat-full": {
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": -3, "n": 2, "stop": ["\n", "end"],
            "logprobs": True, "top_logprobs": 3, "stream": True, "stream_options": {"include_usage": True},
            "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
            "chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": True,
            "response_format": {"type": "text"}, "tools": [], "user": "u", "max_completion_tokens": 4,
        },
        "completion": {"model": "m", "prompt": "once upon", "max_tokens": 4, "echo": False, "logprobs": 2},
        "completion-ids": {"prompt": [[1, 2, 3], "text"], "stop": "x", "best_of": 1, "suffix": None},
        "tokenize": {"prompt": "hello", "add_special_tokens": True},
        "tokenize-chat": {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
        "detokenize": {"tokens": [1, 2, 3]},
    }
    for name, body in bodies.items():
        put("server_request", name, json.dumps(body))


def llama2c_seeds():
    """Version 0 (the 7-int header), 1 and 2 headers of a tiny model, without weights; the
    loader's own writer makes full files in the property tests."""
    fields = struct.pack("<7i", 8, 16, 2, 2, 1, 8, 4)
    put("llama2c_bin", "v0-header", fields)
    magic = 0x616B3432
    for version in (1, 2):
        h = struct.pack("<Ii", magic, version) + fields + (b"\x01" if version == 1 else b"\x00")
        put("llama2c_bin", f"v{version}-header", h + bytes(256 - len(h)))
    # tokenizer.bin: max_token_length, then (score f32, len i32, bytes) per token.
    pieces = [b"<unk>", b"<s>", b"</s>", b"<0x0A>", b" a", b"b", b"ab", b"\xe2\x96\x81the"]
    vocab = struct.pack("<I", 16) + b"".join(struct.pack("<fi", -i, len(p)) + p for i, p in enumerate(pieces))
    put("llama2c_tokenizer", "eight-tokens", struct.pack("<I", len(pieces)) + b"\x00" + vocab)
    put("llama2c_tokenizer", "more-allowed", struct.pack("<I", 4) + b"\x01" + vocab)


if __name__ == "__main__":
    safetensors_seeds()
    json_seeds()
    gguf_seeds()
    server_seeds()
    llama2c_seeds()
