"""Benchmark models of the new families: the exact layer shapes of a published size that fits
this machine, seeded random BF16 weights, as a Hugging Face directory for Kylin and the same
weights as a GGUF for llama.cpp (as testdata/models/make_bench_model.py does for Qwen3-0.6B).

    python make_family_bench_models.py OUT_DIR [gemma3-1b-shaped gemma4-e2b-shaped qwen3-moe-shaped
                                                gpt-oss-20b-shaped ...]

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

Needs numpy and gguf (the fetch script's venv, $KYLIN_MODELS/.venv, has both); the twins that
llama.cpp's own converter makes (llamacpp_convert.py: Gemma 4, the MoE models, gpt-oss) need
torch and transformers too, and the script stops if the converter fails.
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


def write_safetensors_streamed(path, shapes, fill):
    """A BF16 safetensors file of `shapes` (name -> shape), each tensor's bits written by
    `fill(name, shape, write)` in pieces, so that no more than a piece is held in memory."""
    hdr, off, order = {}, 0, sorted(shapes)
    for k in order:
        n = 2 * int(np.prod(shapes[k]))
        hdr[k] = {"dtype": "BF16", "shape": list(shapes[k]), "data_offsets": [off, off + n]}
        off += n
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k in order:
            fill(k, shapes[k], lambda bits: f.write(bits.tobytes()))


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


# Gemma-4-E2B (google/gemma-4-E2B-it's text_config): 35 layers, four sliding (window 512, head
# width 256, one KV head) to one full (head width 512, proportional RoPE on a quarter), the last
# 20 layers reusing the keys and values of layers 13 (sliding) and 14 (full) with a double-wide
# MLP, per-layer inputs of 256, final soft-cap 30. The language model of the published
# Gemma4ForConditionalGeneration, as Gemma4ForCausalLM (no vision or audio tower).
GEMMA4_E2B = dict(
    name="gemma4-e2b-shaped", H=1536, L=35, NH=8, NKV=1, HD=256, GHD=512, FF=6144, V=262144, PLE=256, shared=20,
    config={
        "architectures": ["Gemma4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attention_k_eq_v": False, "bos_token_id": 2, "dtype": "bfloat16", "enable_moe_block": False,
        "eos_token_id": [1, 106], "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1536, "hidden_size_per_layer_input": 256,
        "intermediate_size": 6144, "layer_types": ["full_attention" if i % 5 == 4 else "sliding_attention"
                                                   for i in range(35)],
        "max_position_embeddings": 131072, "model_type": "gemma4_text", "num_attention_heads": 8,
        "num_global_key_value_heads": None, "num_hidden_layers": 35, "num_key_value_heads": 1,
        "num_kv_shared_layers": 20, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 512, "tie_word_embeddings": True, "use_double_wide_mlp": True, "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144},
    generation={"bos_token_id": 2, "do_sample": True, "eos_token_id": [1, 106], "pad_token_id": 0, "top_k": 64,
                "top_p": 0.95},
)


def gemma4(spec):
    """Seeded random BF16 in Gemma 4's layout, written tensor by tensor (the model is 9 GiB),
    then its GGUF twin by llama.cpp's own converter (llamacpp_convert.py)."""
    name, H, L, NH, NKV, HD, GHD, FF, V, PLE, shared = (
        spec[k] for k in ("name", "H", "L", "NH", "NKV", "HD", "GHD", "FF", "V", "PLE", "shared"))
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "gguf"), exist_ok=True)
    types = spec["config"]["layer_types"]
    first_shared = L - shared
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "model.embed_tokens_per_layer.weight": (V, L * PLE),
              "model.per_layer_model_projection.weight": (L * PLE, H), "model.per_layer_projection_norm.weight": (PLE,)}
    for i in range(L):
        p = f"model.layers.{i}."
        hd = GHD if types[i] == "full_attention" else HD
        ff = 2 * FF if i >= first_shared else FF
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm", "post_per_layer_input_norm"):
            shapes[p + n + ".weight"] = (H,)
        shapes[p + "layer_scalar"] = (1,)
        shapes[p + "self_attn.q_proj.weight"] = (NH * hd, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, NH * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        if i < first_shared:
            shapes[p + "self_attn.k_proj.weight"] = (NKV * hd, H)
            shapes[p + "self_attn.v_proj.weight"] = (NKV * hd, H)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (ff, H)
        shapes[p + "mlp.up_proj.weight"] = (ff, H)
        shapes[p + "mlp.down_proj.weight"] = (H, ff)
        shapes[p + "per_layer_input_gate.weight"] = (PLE, H)
        shapes[p + "per_layer_projection.weight"] = (H, PLE)
    rng = np.random.default_rng(20261126)

    def fill(k, shape, write):
        if len(shape) == 1 and k.endswith("layer_scalar"):
            write(bf16(np.full(shape, 0.7, dtype=np.float32)))
        elif len(shape) == 1:  # norms: plain `w` in Gemma 4, near one
            write(bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)))
        else:
            rows, cols = shape
            scale = 1.0 / np.sqrt(cols)
            for r in range(0, rows, 8192):
                piece = min(8192, rows - r)
                write(bf16(rng.standard_normal((piece, cols), dtype=np.float32) * scale))

    write_safetensors_streamed(os.path.join(d, "model.safetensors"), shapes, fill)
    json.dump(spec["config"], open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(spec["generation"], open(os.path.join(d, "generation_config.json"), "w"), indent=2)
    print("wrote", d)
    convert = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_convert.py")
    run(f"{sys.executable} {convert} {d} {os.path.join(d, 'gguf', name + '-bf16.gguf')} bf16")


# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json): hidden 2048, 32 query and 4 KV heads of 128,
# 128 experts of width 768, 8 per token, renormalised; the first LAYERS of its 48 layers (the
# experts alone are 1.2 GB per layer in BF16; the twins and both engines' page caches must fit
# this machine). The router's weights are scaled so its logits spread and every expert is used.
QWEN3_MOE_LAYERS = int(os.environ.get("QWEN3_MOE_LAYERS", "4"))
QWEN3_MOE = dict(
    name="qwen3-moe-shaped", L=QWEN3_MOE_LAYERS,
    config={
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": QWEN3_MOE_LAYERS, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936},
    generation={"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                "temperature": 0.7, "top_k": 20, "top_p": 0.8},
)

# gpt-oss-20b (openai/gpt-oss-20b's config.json): hidden 2880, 64 query and 8 KV heads of 64,
# sliding (128) and full attention alternating, 32 experts of width 2880, 4 per token, in MXFP4
# as published (random FP4 codes, E8M0 scales near 2^-6); the first LAYERS of its 24 layers.
GPT_OSS_LAYERS = int(os.environ.get("GPT_OSS_LAYERS", "6"))
GPT_OSS = dict(
    name="gpt-oss-20b-shaped", L=GPT_OSS_LAYERS,
    config={
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(GPT_OSS_LAYERS)],
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": GPT_OSS_LAYERS, "num_key_value_heads": 8,
        "num_local_experts": 32, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 201088},
    generation={"bos_token_id": 199998, "do_sample": True, "eos_token_id": [200002, 199999, 200012],
                "pad_token_id": 199999},
)


def run(command):
    """Runs a shell command (llama.cpp's converter or quantizer); a failure stops the script,
    so a missing twin is never mistaken for a written one."""
    status = os.system(command)
    if status != 0:
        sys.exit(f"failed ({status}): {command}\n(the converter needs torch and transformers in this Python)")


def write_any_safetensors(path, specs, fill):
    """A safetensors file of `specs` (name -> (dtype, shape)), each tensor written by
    `fill(name, shape, write)` in pieces; dtype is "BF16" or "U8"."""
    hdr, off, order = {}, 0, sorted(specs)
    for k in order:
        dtype, shape = specs[k]
        n = (2 if dtype == "BF16" else 1) * int(np.prod(shape))
        hdr[k] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hdr["__metadata__"] = {"format": "pt"}
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k in order:
            fill(k, specs[k][1], lambda data: f.write(data.tobytes()))


def twins(d, name, types):
    """GGUF twins by llama.cpp's own converter (bf16, q8_0) and quantizer (q4_k_m)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for t in types:
        target = os.path.join(d, "gguf", f"{name}-{t}.gguf")
        if os.path.exists(target):
            continue
        if t in ("bf16", "q8_0", "auto"):
            run(f"{sys.executable} {os.path.join(here, 'llamacpp_convert.py')} {d} {target} {t}")
        elif t == "q4_k_m":
            source = os.path.join(d, "gguf", f"{name}-bf16.gguf")
            quantize = os.path.join(here, "..", "target", "release", "examples", "gguf_quantize")
            run(f"{quantize} {source} {target} q4_k_m")


def qwen3_moe(spec):
    name, L = spec["name"], spec["L"]
    c = spec["config"]
    H, NH, NKV, HD, E, W, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                               c["num_experts"], c["moe_intermediate_size"], c["vocab_size"])
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "gguf"), exist_ok=True)
    specs = {"model.embed_tokens.weight": ("BF16", (V, H)), "lm_head.weight": ("BF16", (V, H)),
             "model.norm.weight": ("BF16", (H,))}
    for i in range(L):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = ("BF16", (H,))
        specs[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        specs[p + "self_attn.q_proj.weight"] = ("BF16", (NH * HD, H))
        specs[p + "self_attn.k_proj.weight"] = ("BF16", (NKV * HD, H))
        specs[p + "self_attn.v_proj.weight"] = ("BF16", (NKV * HD, H))
        specs[p + "self_attn.o_proj.weight"] = ("BF16", (H, NH * HD))
        specs[p + "self_attn.q_norm.weight"] = ("BF16", (HD,))
        specs[p + "self_attn.k_norm.weight"] = ("BF16", (HD,))
        specs[p + "mlp.gate.weight"] = ("BF16", (E, H))
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            specs[q + "gate_proj.weight"] = ("BF16", (W, H))
            specs[q + "up_proj.weight"] = ("BF16", (W, H))
            specs[q + "down_proj.weight"] = ("BF16", (H, W))
    rng = np.random.default_rng(20261127)

    def fill(k, shape, write):
        if len(shape) == 1:
            write(bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)))
            return
        rows, cols = shape
        # The router's logits spread (std about 2) so that top-8 of 128 varies across tokens.
        scale = 2.0 / np.sqrt(cols) if k.endswith("mlp.gate.weight") else 1.0 / np.sqrt(cols)
        for r in range(0, rows, 8192):
            piece = min(8192, rows - r)
            write(bf16(rng.standard_normal((piece, cols), dtype=np.float32) * scale))

    write_any_safetensors(os.path.join(d, "model.safetensors"), specs, fill)
    json.dump(spec["config"], open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(spec["generation"], open(os.path.join(d, "generation_config.json"), "w"), indent=2)
    print("wrote", d)
    twins(d, name, ["bf16", "q8_0", "q4_k_m"])


def gpt_oss(spec):
    name, L = spec["name"], spec["L"]
    c = spec["config"]
    H, NH, NKV, HD, E, W, V = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"],
                               c["num_local_experts"], c["intermediate_size"], c["vocab_size"])
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "gguf"), exist_ok=True)
    specs = {"model.embed_tokens.weight": ("BF16", (V, H)), "lm_head.weight": ("BF16", (V, H)),
             "model.norm.weight": ("BF16", (H,))}
    for i in range(L):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = ("BF16", (H,))
        specs[p + "post_attention_layernorm.weight"] = ("BF16", (H,))
        for n, rows, cols in (("q_proj", NH * HD, H), ("k_proj", NKV * HD, H), ("v_proj", NKV * HD, H),
                              ("o_proj", H, NH * HD)):
            specs[f"{p}self_attn.{n}.weight"] = ("BF16", (rows, cols))
            specs[f"{p}self_attn.{n}.bias"] = ("BF16", (rows,))
        specs[p + "self_attn.sinks"] = ("BF16", (NH,))
        specs[p + "mlp.router.weight"] = ("BF16", (E, H))
        specs[p + "mlp.router.bias"] = ("BF16", (E,))
        specs[p + "mlp.experts.gate_up_proj_blocks"] = ("U8", (E, 2 * W, H // 32, 16))
        specs[p + "mlp.experts.gate_up_proj_scales"] = ("U8", (E, 2 * W, H // 32))
        specs[p + "mlp.experts.gate_up_proj_bias"] = ("BF16", (E, 2 * W))
        specs[p + "mlp.experts.down_proj_blocks"] = ("U8", (E, H, W // 32, 16))
        specs[p + "mlp.experts.down_proj_scales"] = ("U8", (E, H, W // 32))
        specs[p + "mlp.experts.down_proj_bias"] = ("BF16", (E, H))
    rng = np.random.default_rng(20261128)

    def fill(k, shape, write):
        if k.endswith("_blocks"):
            for e in range(shape[0]):
                write(rng.integers(0, 256, size=shape[1:], dtype=np.uint8))
        elif k.endswith("_scales"):
            # 2^(e - 127) near 2^-6 to 2^-4: weights of a few hundredths, as in a trained model.
            write(rng.integers(121, 124, size=shape, dtype=np.uint8))
        elif len(shape) == 1 and "norm" in k:
            write(bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)))
        elif len(shape) == 1 or k.endswith("_bias"):
            write(bf16(0.02 * rng.standard_normal(shape, dtype=np.float32)))
        else:
            rows, cols = shape
            scale = 2.0 / np.sqrt(cols) if "router" in k else 1.0 / np.sqrt(cols)
            for r in range(0, rows, 8192):
                piece = min(8192, rows - r)
                write(bf16(rng.standard_normal((piece, cols), dtype=np.float32) * scale))

    write_any_safetensors(os.path.join(d, "model.safetensors"), specs, fill)
    json.dump(spec["config"], open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(spec["generation"], open(os.path.join(d, "generation_config.json"), "w"), indent=2)
    print("wrote", d)
    # llama.cpp's converter keeps MXFP4 experts as MXFP4 (`auto` keeps the rest BF16).
    twins(d, name, ["auto"])



# Qwen3.5-0.8B (Qwen/Qwen3.5-0.8B's text_config): 24 layers, three Gated DeltaNet layers (16
# key and 16 value heads of 128, a convolution of 4 taps) to one gated full-attention layer (8
# heads of 256, 2 KV heads, a quarter of each head rotated, interleaved RoPE sections), SwiGLU of
# 3584, a tied embedding of 248320. Written in the layout Qwen3.5 is published in
# (Qwen3_5ForConditionalGeneration: `text_config`, weights under `model.language_model.*`),
# with the multi-token-prediction head the published checkpoint ships (`mtp.*`: its projection,
# norms and one gated full-attention layer, which `kylin --mtp` runs as the speculative
# proposer); the vision tower is left out. llama.cpp's converter runs with --no-mtp (the
# vendored llama.cpp does not speculate with the head). The head's tensors come after every
# other tensor in the file, so the decoder's seeded values are those of the model without it.
QWEN35_08B = dict(
    name="qwen3.5-0.8b-shaped", H=1024, L=24, NH=8, NKV=2, HD=256, FF=3584, V=248320, HK=16, HV=16, DK=128,
    DV=128, K=4,
    config={
        "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
            "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3584,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 16, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
            "mamba_ssm_dtype": "float32", "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False, "num_attention_heads": 8, "num_hidden_layers": 24,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "tie_word_embeddings": True, "use_cache": True,
            "vocab_size": 248320,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
        "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
        "vision_end_token_id": 248054, "vision_start_token_id": 248053,
        "vision_config": {"deepstack_visual_indexes": [], "depth": 12, "hidden_act": "gelu_pytorch_tanh",
                          "hidden_size": 768, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 3072,
                          "model_type": "qwen3_5", "num_heads": 12, "num_position_embeddings": 2304,
                          "out_hidden_size": 1024, "patch_size": 16, "spatial_merge_size": 2,
                          "temporal_patch_size": 2}},
    generation={"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                "temperature": 0.6, "top_k": 20, "top_p": 0.95},
)


# Qwen3.5-35B-A3B (Qwen/Qwen3.5-35B-A3B's text_config): hidden 2048, gated DeltaNet with 16 key
# and 32 value heads of 128, gated full attention (16 query and 2 KV heads of 256) on every
# fourth layer, 256 experts of width 512 with 8 per token and a sigmoid-gated shared expert of
# 512, untied head; the first LAYERS of its 40 layers (the experts alone are 1.6 GB per layer in
# BF16), in the published ConditionalGeneration layout (stacked experts `mlp.experts.gate_up_proj`
# and `down_proj`) without the vision tower and without the MTP head.
QWEN35_MOE_LAYERS = int(os.environ.get("QWEN35_MOE_LAYERS", "4"))
QWEN35_35B_A3B = dict(
    name="qwen3.5-moe-shaped", H=2048, L=QWEN35_MOE_LAYERS, NH=16, NKV=2, HD=256, FF=None, V=248320, HK=16, HV=32,
    DK=128, DV=128, K=4, E=256, W=512, SW=512, mtp=False,
    config={
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
            "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
            "hidden_size": 2048, "initializer_range": 0.02,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                            for i in range(QWEN35_MOE_LAYERS)],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
            "mamba_ssm_dtype": "float32", "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
            "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
            "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": QWEN35_MOE_LAYERS,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "use_cache": True,
            "vocab_size": 248320,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
        "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
        "vision_end_token_id": 248054, "vision_start_token_id": 248053},
    generation={"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
                "temperature": 0.6, "top_k": 20, "top_p": 0.95},
)


def qwen35(spec):
    name, H, L, NH, NKV, HD, FF, V = (spec[k] for k in ("name", "H", "L", "NH", "NKV", "HD", "FF", "V"))
    HK, HV, DK, DV, K = (spec[k] for k in ("HK", "HV", "DK", "DV", "K"))
    d = os.path.join(out, name)
    os.makedirs(os.path.join(d, "gguf"), exist_ok=True)
    lm = "model.language_model."
    shapes = {lm + "embed_tokens.weight": (V, H), lm + "norm.weight": (H,)}
    conv = 2 * HK * DK + HV * DV
    for i in range(L):
        p = f"{lm}layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if (i + 1) % 4 == 0:
            shapes[p + "self_attn.q_proj.weight"] = (2 * NH * HD, H)
            shapes[p + "self_attn.k_proj.weight"] = (NKV * HD, H)
            shapes[p + "self_attn.v_proj.weight"] = (NKV * HD, H)
            shapes[p + "self_attn.o_proj.weight"] = (H, NH * HD)
            shapes[p + "self_attn.q_norm.weight"] = (HD,)
            shapes[p + "self_attn.k_norm.weight"] = (HD,)
        else:
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (conv, H)
            shapes[p + "linear_attn.in_proj_z.weight"] = (HV * DV, H)
            shapes[p + "linear_attn.in_proj_b.weight"] = (HV, H)
            shapes[p + "linear_attn.in_proj_a.weight"] = (HV, H)
            shapes[p + "linear_attn.conv1d.weight"] = (conv, 1, K)
            shapes[p + "linear_attn.A_log"] = (HV,)
            shapes[p + "linear_attn.dt_bias"] = (HV,)
            shapes[p + "linear_attn.norm.weight"] = (DV,)
            shapes[p + "linear_attn.out_proj.weight"] = (H, HV * DV)
        if spec.get("E"):
            E, W, SW = spec["E"], spec["W"], spec["SW"]
            shapes[p + "mlp.gate.weight"] = (E, H)
            shapes[p + "mlp.experts.gate_up_proj"] = (E, 2 * W, H)
            shapes[p + "mlp.experts.down_proj"] = (E, H, W)
            shapes[p + "mlp.shared_expert.gate_proj.weight"] = (SW, H)
            shapes[p + "mlp.shared_expert.up_proj.weight"] = (SW, H)
            shapes[p + "mlp.shared_expert.down_proj.weight"] = (H, SW)
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (FF, H)
            shapes[p + "mlp.up_proj.weight"] = (FF, H)
            shapes[p + "mlp.down_proj.weight"] = (H, FF)
    if not spec["config"].get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (V, H)
    if not spec.get("mtp", True):
        return write_qwen35(spec, d, shapes)
    # The MTP head: fc (hidden, 2 hidden), its norms, one full-attention layer with its MLP.
    shapes["mtp.fc.weight"] = (H, 2 * H)
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        shapes[norm] = (H,)
    m = "mtp.layers.0."
    for k, shape in (("input_layernorm.weight", (H,)), ("post_attention_layernorm.weight", (H,)),
                     ("self_attn.q_proj.weight", (2 * NH * HD, H)), ("self_attn.k_proj.weight", (NKV * HD, H)),
                     ("self_attn.v_proj.weight", (NKV * HD, H)), ("self_attn.o_proj.weight", (H, NH * HD)),
                     ("self_attn.q_norm.weight", (HD,)), ("self_attn.k_norm.weight", (HD,)),
                     ("mlp.gate_proj.weight", (FF, H)), ("mlp.up_proj.weight", (FF, H)),
                     ("mlp.down_proj.weight", (H, FF))):
        shapes[m + k] = shape
    write_qwen35(spec, d, shapes)


def write_qwen35(spec, d, shapes):
    name = spec["name"]
    rng = np.random.default_rng(20261127)

    def fill(k, shape, write):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [experts, rows, cols]
            scale = 1.0 / np.sqrt(shape[2])
            for e in range(shape[0]):
                write(bf16(rng.standard_normal(shape[1:], dtype=np.float32) * scale))
        elif k.endswith("mlp.gate.weight"):  # the router's logits spread so that every expert is used
            write(bf16(rng.standard_normal(shape, dtype=np.float32) * (2.0 / np.sqrt(shape[1]))))
        elif k.endswith("A_log"):  # decays of about e^-1 per token, as trained models have
            write(bf16(np.log(rng.uniform(0.5, 2.0, shape)).astype(np.float32)))
        elif k.endswith("dt_bias"):
            write(bf16(rng.uniform(-1.0, 1.0, shape).astype(np.float32)))
        elif k.endswith("linear_attn.norm.weight"):  # the gated norm scales by w
            write(bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)))
        elif len(shape) == 1:  # the other norms scale by 1 + w
            write(bf16(0.1 * rng.standard_normal(shape, dtype=np.float32)))
        elif len(shape) == 3:
            write(bf16(rng.standard_normal(shape, dtype=np.float32) * 0.5))
        else:
            rows, cols = shape
            scale = 1.0 / np.sqrt(cols)
            for r in range(0, rows, 8192):
                piece = min(8192, rows - r)
                write(bf16(rng.standard_normal((piece, cols), dtype=np.float32) * scale))

    write_safetensors_streamed(os.path.join(d, "model.safetensors"), shapes, fill)
    json.dump(spec["config"], open(os.path.join(d, "config.json"), "w"), indent=2)
    json.dump(spec["generation"], open(os.path.join(d, "generation_config.json"), "w"), indent=2)
    print("wrote", d)
    convert = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_convert.py")
    run(f"{sys.executable} {convert} {d} {os.path.join(d, 'gguf', name + '-bf16.gguf')} bf16 --no-mtp")

if not only or GEMMA3_1B["name"] in only:
    gemma3(GEMMA3_1B)
if not only or QWEN3_MOE["name"] in only:
    qwen3_moe(QWEN3_MOE)
if not only or GPT_OSS["name"] in only:
    gpt_oss(GPT_OSS)
if not only or GEMMA4_E2B["name"] in only:
    gemma4(GEMMA4_E2B)
if not only or QWEN35_08B["name"] in only:
    qwen35(QWEN35_08B)
if not only or QWEN35_35B_A3B["name"] in only:
    qwen35(QWEN35_35B_A3B)
