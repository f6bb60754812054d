"""More tiny checkpoints of the families, in configurations that testdata/families does not
cover, and what transformers computes on them (float32, eager attention).

The shared fixtures (written by testdata/families/make_arch_fixtures.py) fix one configuration
per family; these vary what a family's resolver decides: other windows and layer counts, one KV
head, defaults left out of config.json, untied heads, biases, other multipliers and patterns.
The weights are seeded random BF16 (as in the shared script), the cases random ids.

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch transformers==5.24.0 safetensors
    /tmp/tvenv/bin/python scripts/make_family_fixtures.py tests/fixtures/families [NAME ...]

writes OUT/fixtures/NAME (save_pretrained) and OUT/reference/NAME.json (the shared format:
cases of 1, 9, 41 and 90 tokens with input_ids, argmax_per_position, greedy_new_ids and
last_logits).
"""
import json, os, shutil, sys, zlib

import torch
import transformers as T

out = sys.argv[1]
only = set(sys.argv[2:])
FIX, REF = os.path.join(out, "fixtures"), os.path.join(out, "reference")
for d in (FIX, REF):
    os.makedirs(d, exist_ok=True)


def randomize(model, seed):
    """The shared script's rule: norms near 1 (Gemma's stored offsets near 0.5..1.5), biases
    small, matrices scaled by 1.5 / sqrt(fan_in) so the logits are well separated."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name or leaf == "weight" and p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif leaf.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else p.shape[0]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
        # LFM2-MoE's selection bias is a buffer; random, so that it changes which experts win.
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


BASE = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
            rms_norm_eps=1e-5, tie_word_embeddings=False)

# name -> (model class, config class, config kwargs, keys to drop from config.json afterwards
# so that the resolver's defaults are exercised; or a dict of keys to set, None dropping one)
SPECS = {
    # Window 5, odd layer count, head_dim 32, no final soft-cap, MQA.
    "tiny-gemma2-w5-mqa": ("Gemma2ForCausalLM", "Gemma2Config",
        dict(BASE, head_dim=32, sliding_window=5, query_pre_attn_scalar=24, final_logit_softcapping=None,
             attn_logit_softcapping=20.0, tie_word_embeddings=True), []),
    # 8 layers with pattern 3 (two global layers), window 6, untied head, linear scaling on the
    # global RoPE only (as Gemma 3 4B publishes it), default query_pre_attn_scalar left out.
    "tiny-gemma3-p3-linear": ("Gemma3ForCausalLM", "Gemma3TextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=8, sliding_window=6, sliding_window_pattern=3,
             num_key_value_heads=2, query_pre_attn_scalar=16, tie_word_embeddings=False,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), []),
    # Window 5 on every layer, one KV head.
    "tiny-mistral-w5-mqa": ("MistralForCausalLM", "MistralConfig",
        dict(BASE, sliding_window=5, head_dim=16), []),
    # Phi-3 with partial rotary (Phi-4-mini rotates 3/4 of each head) and a window.
    "tiny-phi3-partial-swa": ("Phi3ForCausalLM", "Phi3Config",
        dict(BASE, num_key_value_heads=2, partial_rotary_factor=0.75, sliding_window=7, pad_token_id=0), []),
    # Phi-3's LongRoPE (Phi-3-mini-128k, Phi-4-mini) with partial rotary: short factors within
    # the original 64 positions, long ones past them (transformers picks by the sequence's
    # length; Kylin by the planned context, so the test plans 64 or 256 accordingly).
    "tiny-phi3-longrope": ("Phi3ForCausalLM", "Phi3Config",
        dict(BASE, num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
             pad_token_id=0, rope_parameters={
                 "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}), []),
    # NoPE every third layer, untied.
    "tiny-smollm3-every3": ("SmolLM3ForCausalLM", "SmolLM3Config",
        dict(BASE, no_rope_layer_interval=3, tie_word_embeddings=False, pad_token_id=0), ["no_rope_layers"]),
    # Biases on q, k, v and o; tied head.
    "tiny-olmo2-bias": ("Olmo2ForCausalLM", "Olmo2Config",
        dict(BASE, attention_bias=True, tie_word_embeddings=True), []),
    # Other multipliers, untied head, MLP biases.
    "tiny-granite-mlpbias": ("GraniteForCausalLM", "GraniteConfig",
        dict(BASE, embedding_multiplier=6.0, residual_multiplier=0.5, attention_multiplier=0.2,
             logits_scaling=3.0, mlp_bias=True, attention_bias=True), []),
    # Gemma 4 as the small published sizes are built: the last three layers reuse the keys and
    # values of the last earlier layer of their type, with a double-wide MLP; full layers of
    # head width 32 with one KV head whose values are the keys' projection; per-layer inputs
    # of 16; a final soft-cap; other RoPE bases and half the frequencies on full layers;
    # untied head.
    "tiny-gemma4-kvshare": ("Gemma4ForCausalLM", "Gemma4TextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=8, num_key_value_heads=2, sliding_window=6,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
             num_kv_shared_layers=3, use_double_wide_mlp=True, attention_k_eq_v=True, global_head_dim=32,
             num_global_key_value_heads=1, final_logit_softcapping=30.0, hidden_size_per_layer_input=16,
             vocab_size_per_layer_input=1024,
             rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                 "rope_theta": 500000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0}}), []),
    # Gemma 4 without per-layer inputs, with attention biases, and the config layout of the
    # published checkpoints: `global_head_dim` instead of `per_layer_config`, and no
    # `layer_types` or `rope_parameters`, so the defaults decide (five sliding to one full, the
    # last layer forced full; proportional RoPE on a quarter of the global heads).
    "tiny-gemma4-legacy-nople": ("Gemma4ForCausalLM", "Gemma4TextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=7, num_key_value_heads=2, sliding_window=5,
             hidden_size_per_layer_input=0, attention_bias=True, global_head_dim=64, tie_word_embeddings=True),
        {"per_layer_config": None, "layer_types": None, "rope_parameters": None, "global_head_dim": 64}),
    # Mixture-of-Experts in other configurations: 12 experts, top 3, renormalised, every second
    # layer sparse and layer 3 dense (decoder_sparse_step, mlp_only_layers), experts of width 64.
    "tiny-qwen3-moe-k3-sparse": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
        dict(BASE, head_dim=16, num_key_value_heads=2, num_hidden_layers=5, num_experts=12, num_experts_per_tok=3,
             moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3]), []),
    # One expert per token, renormalised (weight 1), a wider shared expert, untied head.
    "tiny-qwen2-moe-k1": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(BASE, num_key_value_heads=2, num_experts=6, num_experts_per_tok=1, moe_intermediate_size=32,
             shared_expert_intermediate_size=160, norm_topk_prob=True), []),
    # Six experts, top 3, a sliding window of 6.
    "tiny-mixtral-w6-k3": ("MixtralForCausalLM", "MixtralConfig",
        dict(BASE, head_dim=16, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=3,
             intermediate_size=64, sliding_window=6), []),
    # 16 experts, top 4, renormalised.
    "tiny-olmoe-k4-norm": ("OlmoeForCausalLM", "OlmoeConfig",
        dict(BASE, num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, intermediate_size=32,
             norm_topk_prob=True), []),
    # Six experts, top 3, a window of 5, another clamp, full attention on layers 0 and 3.
    "tiny-gpt-oss-k3": ("GptOssForCausalLM", "GptOssConfig",
        dict(BASE, head_dim=16, num_local_experts=6, num_experts_per_tok=3, sliding_window=5, intermediate_size=32,
             swiglu_limit=3.0, max_position_embeddings=4096, num_hidden_layers=4,
             layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]), []),
    # Qwen3.5 with grouped value heads (3 per key head), key and value heads of other widths,
    # a convolution of 3 taps, full attention every second layer from `full_attention_interval`
    # (layer_types left out), head_dim 32 with one KV head, half the head rotated, RoPE
    # sections written as the published checkpoints write them, a tied head.
    "tiny-qwen3.5-gqa-interval": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
        dict(BASE, head_dim=32, num_hidden_layers=5, linear_num_key_heads=2, linear_num_value_heads=6,
             linear_key_head_dim=24, linear_value_head_dim=20, linear_conv_kernel_dim=3, full_attention_interval=2,
             tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
        {"layer_types": None, "full_attention_interval": 2}),
    # LFM2 as its published configurations are written: the MLP width adjusted from
    # intermediate_size (2/3, times 1.5, rounded up to 64), attention layers from
    # `full_attn_idxs` (layer_types left out), convolutions of 4 taps with biases, and the
    # untied head named by `tie_embedding`.
    # Qwen3.5-MoE with 12 experts, top 3, a wider shared expert, grouped value heads (2 per key
    # head), full attention every second layer from `full_attention_interval` (layer_types left
    # out), one KV head.
    "tiny-qwen3.5-moe-k3-interval": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=24, num_experts=12, num_experts_per_tok=3,
             moe_intermediate_size=32, shared_expert_intermediate_size=96, full_attention_interval=2,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
        {"layer_types": None, "full_attention_interval": 2}),
    "tiny-lfm2-autoff-bias": ("Lfm2ForCausalLM", "Lfm2Config",
        dict(BASE, intermediate_size=200, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.5,
             block_multiple_of=64, num_key_value_heads=2, full_attn_idxs=[0, 3], conv_L_cache=4, conv_bias=True,
             norm_eps=1e-5, tie_word_embeddings=False),
        {"layer_types": None, "tie_word_embeddings": None, "tie_embedding": False}),
    # LFM2-MoE: two dense layers first, then 8 experts of width 32, top 3, renormalised and
    # scaled by 2.5, chosen with a random selection bias; attention on layers 1 and 4.
    "tiny-lfm2-moe-dense2-bias": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
        dict(BASE, num_hidden_layers=5, num_key_value_heads=2, num_dense_layers=2, num_experts=8,
             num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, routed_scaling_factor=2.5,
             use_expert_bias=True, norm_eps=1e-5, conv_L_cache=3,
             layer_types=["conv", "full_attention", "conv", "conv", "full_attention"]), []),
    # LFM2-MoE with every layer sparse, no renormalisation, no selection bias, top 2 of 6,
    # convolutions of 4 taps with biases, a tied head; the routing fields left to defaults
    # where they are the defaults.
    "tiny-lfm2-moe-nonorm": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
        dict(BASE, num_hidden_layers=4, num_key_value_heads=1, num_dense_layers=0, num_experts=6,
             num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False, use_expert_bias=False,
             conv_L_cache=4, conv_bias=True, tie_word_embeddings=True,
             layer_types=["full_attention", "conv", "conv", "full_attention"]),
        ["routed_scaling_factor"]),
    # Qwen3-Next with grouped value heads (3 per key head, so the fused in_proj_qkvz and
    # in_proj_ba interleave three value heads per group), full attention every second layer from
    # `full_attention_interval` (layer_types left out), experts on every second layer but layer
    # 3 (decoder_sparse_step, mlp_only_layers), top 3 of 8 not renormalised, a shared expert,
    # the default quarter of each head rotated.
    "tiny-qwen3-next-gqa-sparse": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=5, num_key_value_heads=2, linear_num_key_heads=2,
             linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=12, linear_conv_kernel_dim=3,
             num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3], full_attention_interval=2),
        {"layer_types": None, "full_attention_interval": 2}),
    # Qwen3-Next with one value head per key head, experts on every layer renormalised, a tied
    # head, explicit layer_types.
    "tiny-qwen3-next-moe-tied": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
        dict(BASE, head_dim=16, num_hidden_layers=4, num_key_value_heads=1, linear_num_key_heads=4,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
             norm_topk_prob=True, tie_word_embeddings=True,
             layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]), []),
}


def run_cases(model, seqs, n_greedy=20):
    cases = []
    for ids in seqs:
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0].float()
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_greedy,
                                 do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=None)
        cases.append({
            "input_ids": ids,
            "argmax_per_position": [int(a) for a in logits.argmax(-1)],
            "greedy_new_ids": [int(t) for t in gen[0, len(ids):]],
            "last_logits": [round(float(v), 6) for v in logits[-1]],
        })
    return cases


meta_base = "transformers " + T.__version__ + ", torch " + torch.__version__ + ", float32 compute, eager attention"
for name, (cls, cfg_cls, kw, drop) in SPECS.items():
    if only and name not in only:
        continue
    torch.manual_seed(0)
    cfg = getattr(T, cfg_cls)(**kw)
    cfg.dtype = "bfloat16"
    model = getattr(T, cls)(cfg)
    randomize(model, zlib.crc32(name.encode()) % 10000)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    if drop:
        path = os.path.join(d, "config.json")
        config = json.load(open(path))
        for k, v in (drop.items() if isinstance(drop, dict) else ((k, None) for k in drop)):
            if v is None:
                config.pop(k, None)
            else:
                config[k] = v
        json.dump(config, open(path, "w"), indent=2, sort_keys=True)
    ref = getattr(T, cls).from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1024, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": cls, "produced_by": meta_base, "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok ({cls})")


# The layout Gemma 3 (4B and up) is published in: Gemma3ForConditionalGeneration with a nested
# text_config, the language model under model.language_model.*, and a tiny SigLIP vision tower.
# The references are text-only (no image tokens), computed by the full class.
def conditional(name, seed):
    torch.manual_seed(0)
    text = dict(BASE, head_dim=16, num_hidden_layers=6, sliding_window=5, num_key_value_heads=2,
                query_pre_attn_scalar=16, tie_word_embeddings=True)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                         boi_token_index=1000, eoi_token_index=1001, image_token_index=1002)
    cfg.dtype = "bfloat16"
    model = T.Gemma3ForConditionalGeneration(cfg)
    randomize(model, seed)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    ref = T.Gemma3ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1000, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": "Gemma3ForConditionalGeneration", "produced_by": meta_base,
            "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok (Gemma3ForConditionalGeneration)")


if not only or "tiny-gemma3-vl" in only:
    conditional("tiny-gemma3-vl", 777)
    # The same weights under transformers 5's in-memory names (`model.language_model.*`,
    # `lm_head.weight`), which other tools write: both layouts must load to the same logits.
    from safetensors.torch import load_file, save_file
    src = os.path.join(FIX, "tiny-gemma3-vl")
    dst = os.path.join(FIX, "tiny-gemma3-vl-v5-names")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    def rename(k):
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector.")):
            if k.startswith(old):
                return new + k[len(old):]
        return k
    save_file({rename(k): v for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(REF, "tiny-gemma3-vl.json"), os.path.join(REF, "tiny-gemma3-vl-v5-names.json"))
    print("tiny-gemma3-vl-v5-names: ok (renamed copy)")


# The layout Gemma 4 is published in: Gemma4ForConditionalGeneration, the language model under
# model.language_model.*, a tiny vision tower; per-layer inputs and shared keys and values.
if not only or "tiny-gemma4-vl" in only:
    name = "tiny-gemma4-vl"
    torch.manual_seed(0)
    text = dict(BASE, head_dim=16, num_hidden_layers=6, num_key_value_heads=2, sliding_window=5,
                num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=1024,
                global_head_dim=32, tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                             "sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64,
                  pooling_kernel_size=2)
    cfg = T.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=1001,
                         eoi_token_id=1002, image_token_id=1000, video_token_id=1003, boa_token_id=1004,
                         eoa_token_index=1005, audio_token_id=1006)
    cfg.dtype = "bfloat16"
    model = T.Gemma4ForConditionalGeneration(cfg)
    randomize(model, 4444)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    ref = T.Gemma4ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(3, 1000, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": "Gemma4ForConditionalGeneration", "produced_by": meta_base,
            "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok (Gemma4ForConditionalGeneration)")


# The other expert layout of each family (the same weights, renamed and reshaped; the same
# reference): one tensor per expert where transformers saves them stacked (gpt-oss, Gemma 4),
# stacked where it saves one per expert (Qwen3-MoE). Kylin must give the same logits for both.
def relayout(src_name, dst_name, convert):
    from safetensors.torch import load_file, save_file
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testdata", "families")
    src = os.path.join(shared, "fixtures", src_name)
    dst = os.path.join(FIX, dst_name)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(convert(tensors), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(shared, "reference", src_name + ".json"), os.path.join(REF, dst_name + ".json"))
    print(f"{dst_name}: ok (relayout of {src_name})")


def gpt_oss_per_expert(t):
    out = {}
    for k, v in t.items():
        prefix, _, leaf = k.rpartition("mlp.experts.")
        if not prefix:
            out[k] = v
        elif leaf == "gate_up_proj":      # [E, hidden, 2w] input-major, gate/up interleaved
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :, 0::2].t().contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, :, 1::2].t().contiguous()
        elif leaf == "gate_up_proj_bias":
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.bias"] = v[e, 0::2].contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.bias"] = v[e, 1::2].contiguous()
        elif leaf == "down_proj":         # [E, w, hidden]
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].t().contiguous()
        elif leaf == "down_proj_bias":
            for e in range(v.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.bias"] = v[e].contiguous()
    return out


def gemma4_per_expert(t):
    out = {}
    for k, v in t.items():
        prefix, _, leaf = k.rpartition("experts.")
        if not prefix or "." in leaf:
            out[k] = v
        elif leaf == "gate_up_proj":      # [E, 2w, hidden], gate rows first
            w = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = v[e, :w].contiguous()
                out[f"{prefix}experts.{e}.up_proj.weight"] = v[e, w:].contiguous()
        elif leaf == "down_proj":         # [E, hidden, w]
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def qwen3_moe_stacked(t):
    import re
    out, experts = {}, {}
    for k, v in t.items():
        m = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in ids])
        out[prefix + "down_proj"] = torch.stack([by_expert[e]["down"] for e in ids])
    return out


for src, dst, convert in (("tiny-gpt-oss", "tiny-gpt-oss-per-expert", gpt_oss_per_expert),
                          ("tiny-gemma4-moe", "tiny-gemma4-moe-per-expert", gemma4_per_expert),
                          ("tiny-qwen3-moe", "tiny-qwen3-moe-stacked", qwen3_moe_stacked),
                          ("tiny-qwen3.5-moe", "tiny-qwen3.5-moe-stacked", qwen3_moe_stacked)):
    if not only or dst in only:
        relayout(src, dst, convert)


# gpt-oss as it is published: the experts in MXFP4 (`*_blocks`: two FP4 E2M1 codes per byte,
# the even column in the low nibble; `*_scales`: one E8M0 byte per 32 columns; rows are the
# outputs, gate and up interleaved as in the BF16 layout), everything else BF16, and
# `quantization_config: {quant_method: mxfp4}`. transformers dequantizes MXFP4 on a CPU; its
# float32 forward over those weights is the reference.
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def to_mxfp4(w):
    """[..., out, in] float -> blocks [..., out, in / 32, 16] and scales [..., out, in / 32]."""
    *lead, rows, cols = w.shape
    blocks32 = w.float().reshape(*lead, rows, cols // 32, 32)
    amax = blocks32.abs().amax(-1).clamp(min=1e-30)
    e = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)          # largest value fits 6 · 2^e
    scaled = blocks32 / torch.pow(2.0, e).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)   # nearest FP4 value
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (e + 127).to(torch.uint8)


if not only or "tiny-gpt-oss-mxfp4" in only:
    from safetensors.torch import load_file, save_file
    name = "tiny-gpt-oss-mxfp4"
    torch.manual_seed(0)
    cfg = T.GptOssConfig(**dict(BASE, head_dim=16, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2,
                                sliding_window=6, intermediate_size=64, max_position_embeddings=4096))
    cfg.dtype = "bfloat16"
    model = T.GptOssForCausalLM(cfg)
    randomize(model, 5151)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    out = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            blocks, scales = to_mxfp4(v.transpose(1, 2))   # [E, in, out] -> [E, out, in]
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales
        else:
            out[k] = v
    save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(d, "config.json")))
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=2, sort_keys=True)
    ref = T.GptOssForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1024, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": "GptOssForCausalLM", "produced_by": meta_base,
            "dtype_on_disk": "bfloat16 + mxfp4 experts"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok (MXFP4 experts, reference by transformers' dequantization)")
# The layout Qwen3.5 is published in: Qwen3_5ForConditionalGeneration with a nested text_config,
# the language model under model.language_model.*, a tiny vision tower, a tied head (as the
# small sizes publish it), and multi-token-prediction tensors (mtp.*) beside them, which
# transformers ignores on load and Kylin lists as not run.
if not only or "tiny-qwen3.5-vl-mtp" in only:
    name = "tiny-qwen3.5-vl-mtp"
    torch.manual_seed(0)
    text = dict(BASE, head_dim=16, num_hidden_layers=4, num_key_value_heads=2, linear_num_key_heads=4,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True,
                layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=64)
    cfg = T.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001,
                          vision_start_token_id=1002, vision_end_token_id=1003, tie_word_embeddings=True)
    cfg.dtype = "bfloat16"
    model = T.Qwen3_5ForConditionalGeneration(cfg)
    randomize(model, 3535)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    from safetensors.torch import load_file, save_file
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(35)
    for k, shape in (("mtp.fc.weight", [64, 128]), ("mtp.norm.weight", [64]), ("mtp.pre_fc_norm_embedding.weight", [64]),
                     ("mtp.pre_fc_norm_hidden.weight", [64]), ("mtp.layers.0.input_layernorm.weight", [64]),
                     ("mtp.layers.0.mlp.down_proj.weight", [64, 96])):
        tensors[k] = (0.1 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    ref = T.Qwen3_5ForConditionalGeneration.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1000, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": "Qwen3_5ForConditionalGeneration", "produced_by": meta_base,
            "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok (Qwen3_5ForConditionalGeneration)")


# Qwen3.5-MoE in the layout it is published in: Qwen3_5MoeForConditionalGeneration with a nested
# text_config, the language model under model.language_model.*, a tiny vision tower.
if not only or "tiny-qwen3.5-moe-vl" in only:
    name = "tiny-qwen3.5-moe-vl"
    torch.manual_seed(0)
    text = dict(BASE, head_dim=16, num_hidden_layers=4, num_key_value_heads=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=6,
                num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=64)
    cfg = T.Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001,
                             vision_start_token_id=1002, vision_end_token_id=1003, tie_word_embeddings=False)
    cfg.dtype = "bfloat16"
    model = T.Qwen3_5MoeForConditionalGeneration(cfg)
    randomize(model, 3636)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    ref = T.Qwen3_5MoeForConditionalGeneration.from_pretrained(d, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1000, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": "Qwen3_5MoeForConditionalGeneration", "produced_by": meta_base,
            "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(ref, seqs)}, open(os.path.join(REF, name + ".json"), "w"))
    print(f"{name}: ok (Qwen3_5MoeForConditionalGeneration)")
