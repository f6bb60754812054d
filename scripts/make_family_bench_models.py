"""Benchmark models of the new families: the exact layer shapes of a published size that fits
this machine, seeded random BF16 weights, as a Hugging Face directory for Kylin and the same
weights as a GGUF for llama.cpp (as ../shared/models/make_bench_model.py does for Qwen3-0.6B).

    python make_family_bench_models.py OUT_DIR [gemma3-1b-shaped ...]

OUT_DIR/NAME/ gets config.json, generation_config.json and model.safetensors (BF16), and
OUT_DIR/NAME/gguf/NAME-bf16.gguf. The weights are random (generated text is noise); speed does
not depend on their values. No tokenizer: `kylin bench` feeds token ids; the GGUF carries a
placeholder vocabulary of the right size so llama.cpp loads it.

The GGUF follows llama.cpp's own Gemma 3 conversion (convert_hf_to_gguf.py, `Gemma3Model`):
tensor names `blk.N.*`, every RMSNorm weight stored plus one (llama.cpp's norm multiplies by
the stored weight; Gemma's by `1 + w`), the global RoPE base as `rope.freq_base` and the
sliding window as `attention.sliding_window` (llama.cpp fixes Gemma 3's local base at 10000 and
its pattern at 6). The llama.cpp vendored by llama-cpp-sys-2 ships `convert_hf_to_gguf.py`
without its `conversion` package, so it cannot run here; this writes the same layout directly.

Needs numpy and gguf (the fetch script's venv, $KYLIN_MODELS/.venv, has both).
"""
import json
import os
import struct
import sys

import gguf
import numpy as np

out = sys.argv[1]
only = set(sys.argv[2:])

# Gemma-3-1B (google/gemma-3-1b-it config.json): 26 layers, 5 sliding to 1 global, window 512.
GEMMA3_1B = dict(
    name="gemma3-1b-shaped", H=1152, L=26, NH=4, NKV=1, HD=256, FF=6912, V=262144, window=512, pattern=6,
    config={
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144},
    generation={"bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True, "eos_token_id": [1, 106],
                "pad_token_id": 0, "top_k": 64, "top_p": 0.95},
)


def bf16(x):  # f32 -> bf16 bits, round to nearest even
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def f32_of(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors):
    hdr, off, order = {}, 0, sorted(tensors)
    for k in order:
        n = tensors[k].nbytes
        hdr[k] = {"dtype": "BF16", "shape": list(tensors[k].shape), "data_offsets": [off, off + n]}
        off += n
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k in order:
            f.write(tensors[k].tobytes())


def gemma3(spec):
    name, H, L, NH, NKV, HD, FF, V = (spec[k] for k in ("name", "H", "L", "NH", "NKV", "HD", "FF", "V"))
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "gguf"), exist_ok=True)
    rng = np.random.default_rng(20261125)

    def mat(rows, cols):
        return bf16(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)

    def norm(n):  # Gemma stores the offset from one
        return bf16(0.1 * rng.standard_normal(n, dtype=np.float32))

    t = {"model.embed_tokens.weight": mat(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "self_attn.q_proj.weight"] = mat(NH * HD, H)
        t[p + "self_attn.k_proj.weight"] = mat(NKV * HD, H)
        t[p + "self_attn.v_proj.weight"] = mat(NKV * HD, H)
        t[p + "self_attn.o_proj.weight"] = mat(H, NH * HD)
        t[p + "self_attn.q_norm.weight"] = norm(HD)
        t[p + "self_attn.k_norm.weight"] = norm(HD)
        t[p + "post_attention_layernorm.weight"] = norm(H)
        t[p + "pre_feedforward_layernorm.weight"] = norm(H)
        t[p + "post_feedforward_layernorm.weight"] = norm(H)
        t[p + "mlp.gate_proj.weight"] = mat(FF, H)
        t[p + "mlp.up_proj.weight"] = mat(FF, H)
        t[p + "mlp.down_proj.weight"] = mat(H, FF)
    t["model.norm.weight"] = norm(H)
    write_safetensors(os.path.join(d, "model.safetensors"), t)
    json.dump(spec["config"], open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(spec["generation"], open(os.path.join(d, "generation_config.json"), "w"), indent=2)

    w = gguf.GGUFWriter(os.path.join(d, "gguf", f"{name}-bf16.gguf"), "gemma3")
    w.add_name(name)
    w.add_context_length(spec["config"]["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(FF)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(spec["window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # A placeholder SentencePiece vocabulary of the model's size (bench feeds ids).
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<t{i}>" for i in range(4, V)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * V)
    types = [gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (V - 4)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    def put(gg, bits, is_norm=False):
        if is_norm:
            w.add_tensor(gg, f32_of(bits) + np.float32(1.0))
        else:
            w.add_tensor(gg, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)

    put("token_embd.weight", t["model.embed_tokens.weight"])
    put("output_norm.weight", t["model.norm.weight"], True)
    for i in range(L):
        for hf, gg in names.items():
            put(f"blk.{i}.{gg}.weight", t[f"model.layers.{i}.{hf}.weight"], "norm" in hf)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", d)


if not only or GEMMA3_1B["name"] in only:
    gemma3(GEMMA3_1B)
