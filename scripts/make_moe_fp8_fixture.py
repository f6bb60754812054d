#!/usr/bin/env python3
"""Builds `tests/fixtures/quantized/tiny-qwen3-moe-fp8` (issue 34: published FP8 MoE checkpoints)
and its references (kept in the repository; CI does not run this script).

The layout is the one Qwen publishes for Qwen3-30B-A3B-FP8 and Qwen3-235B-A22B-FP8: fine-grained
FP8 (`quant_method: fp8`, `activation_scheme: dynamic`, 128 x 128 blocks), every decoder
projection and every expert's `gate_proj`, `up_proj` and `down_proj` stored one tensor per expert
as F8_E4M3 with a `weight_scale_inv` per block, the routers (`mlp.gate`) and the head kept in
BF16 and listed in `modules_to_not_convert`.

A tiny random Qwen3-MoE (hidden 128, 2 layers, 4 heads of 64, 2 KV heads, 8 experts of width
128, top 2 renormalised, a 512-word vocabulary, separate head) is quantized per block as
transformers' FP8 integration quantizes (`scale = amax / 448`, `q = fp8_e4m3(w / scale)`, the
helper of `make_quantized_fixtures.py`).

References, in the format of `make_quantized_fixtures.py`:
- `reference/tiny-qwen3-moe-fp8.json`: the directory as transformers 5 loads it on a CPU (its
  FP8 integration dequantizes the weights; the loaded experts are checked against the
  per-block products written here), float32, eager attention, with each quantized product's
  input quantized to FP8 E4M3 per token and group of 128 by compressed-tensors' functions, as
  `FP8Linear` and the FP8 expert kernels do on a GPU: the attention projections by pre-hooks,
  the experts by a forward that applies the same rounding to each expert's input and to its
  `act(gate) * up` before `down_proj`; every position of the prompts and their greedy tokens
  (`positions_top20`).
- `reference/weights-only/tiny-qwen3-moe-fp8.json`: the same model with the activations left
  alone.

Run with a Python that has torch, transformers and compressed-tensors:
    python scripts/make_moe_fp8_fixture.py
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_quantized_fixtures import (  # noqa: E402
    FP8_GROUP_ACTIVATIONS, OUT, VOCAB, fp8_blocks, quantize_inputs_fp8_groups, reference, tokenizer)

NAME = "tiny-qwen3-moe-fp8"
EXPERTS, TOP_K, EXPERT_WIDTH, LAYERS = 8, 2, 128, 2


def source_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, moe_intermediate_size=EXPERT_WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=2,
        eos_token_id=1)
    torch.manual_seed(3456)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                # Larger than the default initialisation so that the logits are not all near
                # zero; the routers wider still so that every expert is chosen somewhere.
                p.normal_(0.0, 0.5 if name.endswith("mlp.gate.weight") else 0.08)
    return model.to(torch.bfloat16)


def checkpoint_tensors(model):
    """(tensors as Qwen publishes them, the dequantized float32 value of every quantized matrix
    under its published name)."""
    tensors, dequantized = {}, {}

    def quantize(name, w):
        q, scale_inv, deq = fp8_blocks(w)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = scale_inv
        dequantized[name] = deq

    for key, value in model.state_dict().items():
        if ".mlp.experts." in key:
            prefix, stacked = key.rsplit(".", 1)  # model.layers.L.mlp.experts, gate_up_proj | down_proj
            for e in range(value.shape[0]):
                if stacked == "gate_up_proj":
                    quantize(f"{prefix}.{e}.gate_proj", value[e, :EXPERT_WIDTH])
                    quantize(f"{prefix}.{e}.up_proj", value[e, EXPERT_WIDTH:])
                else:
                    quantize(f"{prefix}.{e}.down_proj", value[e])
        elif key.endswith("_proj.weight") and ".self_attn." in key:
            quantize(key[: -len(".weight")], value)
        else:
            tensors[key] = value.contiguous()
    return tensors, dequantized


def check_loaded_weights(model, dequantized):
    """transformers' loaded projections and experts must be exactly the per-block products
    written here."""
    for layer in range(LAYERS):
        attention = model.model.layers[layer].self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            loaded = getattr(attention, proj).weight.float()
            assert torch.equal(loaded, dequantized[f"model.layers.{layer}.self_attn.{proj}"]), (layer, proj)
        experts = model.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(EXPERTS):
            gate_up = torch.cat([dequantized[f"{prefix}.{e}.gate_proj"], dequantized[f"{prefix}.{e}.up_proj"]])
            assert torch.equal(experts.gate_up_proj[e].float(), gate_up), (layer, e, "gate_up_proj")
            assert torch.equal(experts.down_proj[e].float(), dequantized[f"{prefix}.{e}.down_proj"]), (layer, e)


def quantize_expert_inputs(model):
    """Each expert's input and its `act(gate) * up` rounded to FP8 per token and group of 128
    with compressed-tensors' functions, as the attention projections' pre-hooks round theirs."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(**FP8_GROUP_ACTIVATIONS)

    def rounded(module, x):
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return fake_quantize(x, scale, zero, args)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = rounded(self, hidden_states[token_idx])
            gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            h = rounded(self, self.act_fn(gate) * up)
            h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out

    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.forward = forward.__get__(experts)
    return model


def load(directory, dequantized, activations):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    check_loaded_weights(model, dequantized)
    model.config._attn_implementation = "eager"
    if activations:
        quantize_inputs_fp8_groups(model)
        quantize_expert_inputs(model)
    return model


def main():
    import compressed_tensors
    import transformers

    versions = (f"transformers {transformers.__version__}, torch {torch.__version__}, "
                f"compressed-tensors {compressed_tensors.__version__}")
    model = source_model()
    tensors, dequantized = checkpoint_tensors(model)
    out = OUT / NAME
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["torch_dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"] + [f"model.layers.{l}.mlp.gate" for l in range(LAYERS)]}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer().save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}) + "\n")

    (OUT / "reference" / "weights-only").mkdir(parents=True, exist_ok=True)
    compute = ("float32, eager attention, as transformers loads the directory: dequantized weights, each "
               "quantized product's input (experts included) quantized to FP8 per token and group of 128")
    ref = reference(load(out, dequantized, True), NAME, versions, compute, every_position=True)
    json.dump(ref, open(OUT / "reference" / f"{NAME}.json", "w"))
    compute = "float32, eager attention, dequantized weights, activations not quantized"
    ref = reference(load(out, dequantized, False), NAME, versions, compute)
    json.dump(ref, open(OUT / "reference" / "weights-only" / f"{NAME}.json", "w"))
    print(f"{NAME}: written")


if __name__ == "__main__":
    main()
