#!/usr/bin/env python3
"""Builds the quantized-checkpoint fixtures of issue 13 in tests/fixtures/quantized/ (kept in the
repository; CI does not run this script).

Two tiny random models, a Qwen3 and a Llama (hidden 128, intermediate 384, 2 layers, 4 heads of
64, 2 KV heads, a 512-word vocabulary), are written in BF16 and then quantized by the formats'
real producers:

- compressed-tensors, by llm-compressor (`QuantizationModifier`, data-free: round to nearest,
  so no calibration set): W8A8 (int-quantized), W8A16, W4A16, W4A16_ASYM (pack-quantized),
  FP8_DYNAMIC and FP8_BLOCK (float-quantized);
- Qwen's fine-grained FP8 layout (`quant_method: fp8`, 128 x 128 blocks, `weight_scale_inv`),
  as transformers' FP8 integration quantizes: per block `scale = amax / 448`, `q =
  fp8_e4m3(w / scale)`;
- GPTQ (v1 checkpoint format: `qweight` int32 `[in / 8, out]`, `qzeros` int32 `[groups, out /
  8]` storing zero - 1, `scales` f16 `[groups, out]`, `g_idx`) and AWQ (GEMM version: `qweight`
  int32 `[in, out / 8]` with the nibble order [0, 2, 4, 6, 1, 3, 5, 7], `qzeros`, `scales` f16
  `[groups, out]`), 4 bits, groups of 128, asymmetric, packed as AutoGPTQ / GPTQModel and
  AutoAWQ pack them. Each packed tensor is unpacked again with their unpacking rules (written
  out below) and checked against the integers it was packed from.

For every fixture, `reference/NAME.json` records what transformers computes (float32, eager
attention), in the format of testdata/reference: per input `input_ids`, `last_top20`,
`argmax_per_position`, `greedy_new_ids` (20 greedy tokens), plus the last position's full
logits.

- The schemes that quantize activations, by the real loading path:
  - compressed-tensors W8A8, FP8_DYNAMIC, FP8_BLOCK: `AutoModelForCausalLM.from_pretrained(dir,
    dtype=float32)`: compressed-tensors decompresses the weights on the first forward pass and
    quantizes every quantized Linear's input at run time as the scheme's `input_activations`
    says (int8 per token; FP8 per token; FP8 per token and group of 128);
  - fine-grained FP8 (`quant_method: fp8`, `activation_scheme: dynamic`): transformers'
    dequantized weights (its CPU load) with each quantized Linear's input quantized to FP8
    E4M3 per token and group of 128 columns (`amax / 448` per group), which is what its
    `FP8Linear` computes on a GPU; the rounding is compressed-tensors' own
    (`compute_dynamic_scales_and_zp`, `fake_quantize` with FP8_BLOCK's activation arguments).
- The weight-only schemes: the dequantized weights in a float32 copy of the model (for
  compressed-tensors, transformers' own decompression of the directory, which is also what its
  real loading path computes for them; for GPTQ and AWQ, whose loaders need GPU packages, the
  dequantization written here).

For the schemes that quantize activations, `reference/weights-only/NAME.json` is the same
model with the activations left alone (compressed-tensors' `quantization_enabled = False`;
for `fp8` what transformers computes on a CPU, where it dequantizes the weights and runs no FP8
kernel).

`python scripts/make_quantized_fixtures.py --references [OUT_DIR]` recomputes the references
from the directories already written (no re-quantization).

Run with a Python that has torch, transformers, compressed-tensors and llmcompressor:
    python scripts/make_quantized_fixtures.py [OUT_DIR]
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT = Path(ARGS[0]) if ARGS else ROOT / "tests" / "fixtures" / "quantized"
VOCAB = 512
GROUP = 128
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SCHEMES = ("W8A8", "W8A16", "W4A16", "W4A16_ASYM", "FP8_DYNAMIC", "FP8_BLOCK")
CASES = [[5, 17, 300, 42, 7, 99, 255, 3], [400, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77]]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", bos_token="w2", eos_token="w1")


def base_model(kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(1234 if kind == "qwen3" else 4321)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Larger weights than the default initialisation, so the logits are not all near zero.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model.to(torch.bfloat16)


def reference(model_f32, name, produced_by, compute="float32, eager attention, dequantized weights",
              every_position=False):
    """`every_position`: the greedy tokens from whole-sequence forward passes (no KV cache, so
    every position is computed as in `argmax_per_position`), and each position's top 20 over
    the prompt and the greedy tokens (`positions_top20`)."""
    model_f32.config._attn_implementation = "eager"
    model_f32.eval()
    cases = []
    with torch.no_grad():
        for ids in CASES:
            x = torch.tensor([ids])
            logits = model_f32(x).logits[0]
            last = logits[-1]
            top = torch.topk(last, 20)
            case = {
                "input_ids": ids,
                "last_top20": [[int(i), float(v)] for v, i in zip(top.values, top.indices)],
                "last_logits": [float(v) for v in last],
                "argmax_per_position": logits.argmax(-1).tolist(),
            }
            if every_position:
                seq = list(ids)
                for _ in range(20):
                    seq.append(int(model_f32(torch.tensor([seq])).logits[0, -1].argmax()))
                all_logits = model_f32(torch.tensor([seq])).logits[0]
                case["greedy_new_ids"] = seq[len(ids):]
                case["positions_top20"] = [
                    [[int(i), float(v)] for v, i in zip(*torch.topk(row, 20))] for row in all_logits]
            else:
                case["greedy_new_ids"] = model_f32.generate(x, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                                            pad_token_id=0)[0, len(ids):].tolist()
            cases.append(case)
    return {"model": name, "produced_by": produced_by, "compute": compute, "cases": cases}


def float_copy(model, state):
    """`model`'s architecture in float32 with `state` (name -> dequantized tensor) as weights."""
    copy = type(model)(model.config).to(torch.float32)
    missing, unexpected = copy.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" and model.config.tie_word_embeddings for k in missing), missing
    return copy


def write_dir(out, tensors, config, tok):
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok.save_pretrained(out)


# ---- GPTQ and AWQ: 4 bits, groups of 128, asymmetric, min-max round to nearest ----

def int4_groups(w):
    """`w` [out, in] -> (q [out, in] in 0..15, zero [out, groups] in 0..15, scale [out, groups] f16)."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.clamp(torch.round(g / scale.float()[..., None]) + zero[..., None], 0, 15)
    return q.reshape(out_f, in_f).to(torch.int32), zero.to(torch.int32), scale


def dequant_int4(q, zero, scale):
    out_f, in_f = q.shape
    g = q.reshape(out_f, in_f // GROUP, GROUP).float()
    return ((g - zero.float()[..., None]) * scale.float()[..., None]).reshape(out_f, in_f)


def pack_gptq(q, zero, scale):
    """AutoGPTQ / GPTQModel `pack` (v1): qweight [in / 8, out], value of input `i` in bits
    `4 (i % 8)` of row `i // 8`; qzeros [groups, out / 8] holding zero - 1, output `o` in bits
    `4 (o % 8)`; scales [groups, out]; g_idx [in] = i // group."""
    qt = q.t().contiguous()  # [in, out]
    in_f, out_f = qt.shape
    qweight = torch.zeros(in_f // 8, out_f, dtype=torch.int64)
    for j in range(8):
        qweight |= qt[j::8].to(torch.int64) << (4 * j)
    z = (zero.t().contiguous() - 1).to(torch.int64) & 0xF  # [groups, out]
    qzeros = torch.zeros(z.shape[0], out_f // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    as_i32 = lambda t: ((t + 2**31) % 2**32 - 2**31).to(torch.int32)
    g_idx = torch.arange(in_f, dtype=torch.int32) // GROUP
    return as_i32(qweight), as_i32(qzeros), scale.t().contiguous(), g_idx


def unpack_gptq(qweight, qzeros):
    """GPTQ's dequantization rule (v1): shifts 0, 4, ..., 28 along the packed rows; zeros + 1."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    w = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [in / 8, 8, out]
    w = w.reshape(-1, qweight.shape[1])  # [in, out]
    z = (qzeros[:, :, None] >> shifts[None, None, :]) & 0xF  # [groups, out / 8, 8]
    z = z.reshape(qzeros.shape[0], -1) + 1  # [groups, out]
    return w.t().contiguous(), z.t().contiguous()


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def pack_awq(q, zero, scale):
    """AutoAWQ `WQLinear_GEMM.from_linear`: qweight [in, out / 8], nibble `i` of word `c` holds
    output `8c + AWQ_ORDER[i]`; qzeros [groups, out / 8] the same way (zero itself); scales
    [groups, out]."""
    def pack(t):  # t [rows, out]
        rows, out_f = t.shape
        packed = torch.zeros(rows, out_f // 8, dtype=torch.int64)
        for i in range(8):
            packed |= t[:, AWQ_ORDER[i]::8].to(torch.int64) << (4 * i)
        return ((packed + 2**31) % 2**32 - 2**31).to(torch.int32)
    return pack(q.t().contiguous()), pack(zero.t().contiguous()), scale.t().contiguous()


def unpack_awq(qweight, qzeros):
    """AutoAWQ's `unpack_awq` then `reverse_awq_order`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    def unpack(t):
        v = (t[:, :, None] >> shifts[None, None, :]) & 0xF
        v = v.reshape(t.shape[0], -1)
        order = (torch.arange(v.shape[1]).reshape(-1, 8)[:, AWQ_REVERSE_ORDER]).reshape(-1)
        return v[:, order]
    return unpack(qweight).t().contiguous(), unpack(qzeros).t().contiguous()


# ---- Qwen / transformers fine-grained FP8 ----

def fp8_blocks(w):
    out_f, in_f = w.shape
    bo, bi = -(-out_f // 128), -(-in_f // 128)
    wf = w.float()
    scale_inv = torch.zeros(bo, bi)
    q = torch.zeros(out_f, in_f, dtype=torch.float8_e4m3fn)
    deq = torch.zeros(out_f, in_f)
    for i in range(bo):
        for j in range(bi):
            blk = wf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = blk.abs().amax().clamp(min=1e-12) / 448.0
            qb = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = qb
            deq[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = qb.float() * s
            scale_inv[i, j] = s
    return q, scale_inv, deq


# ---- References by the real loading path ----

ACTIVATION_QUANTIZED = ("w8a8", "fp8-dynamic", "fp8-block", "fp8")
FP8_GROUP_ACTIVATIONS = dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=128, dynamic=True)


def quantized_linears(model):
    """The Linear modules a fine-grained FP8 checkpoint quantized (every decoder projection,
    experts included; not the head, not a MoE router)."""
    return [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in LINEARS]


def quantize_inputs_fp8_groups(model):
    """Pre-hooks quantizing each quantized Linear's input as `FP8Linear` does on a GPU (FP8 E4M3
    per token and group of 128, `amax / 448`), with compressed-tensors' own functions."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(**FP8_GROUP_ACTIVATIONS)

    def hook(module, inputs):
        x = inputs[0]
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=module)
        return (fake_quantize(x, scale, zero, args),) + tuple(inputs[1:])

    for m in quantized_linears(model):
        m.register_forward_pre_hook(hook)
    return model


def load_as_transformers(directory, activations=True, dtype=torch.float32):
    """`directory` as transformers loads it in float32; `activations=False` leaves the
    activations alone (the weights-only computation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    method = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
    if method == "compressed-tensors" and not activations:
        for m in model.modules():
            if hasattr(m, "quantization_scheme"):
                m.quantization_enabled = False
    if method == "fp8" and activations:
        quantize_inputs_fp8_groups(model)
    return model


def f32_hex(t):
    """A float32 tensor's values as hex of their little-endian bytes (exact and compact)."""
    return t.detach().to(torch.float32).contiguous().numpy().tobytes().hex()


def record_input_quantization(names):
    """`reference/input-quantization.json`: real layer inputs of each activation-quantized
    fixture (captured on the first case) and what compressed-tensors' own functions make of
    them, plus crafted rows (ties, zeros, the clamp), so that Kylin's rounding can be checked
    bit for bit."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    crafted = torch.tensor([
        [1.0, -1.0, 0.5, -0.5, 127.5 / 255.0, 0.25, 3e-8, 0.0] * 16,
        [0.0] * 128,
        [-2.0 ** (-20)] + [2.0 ** (-30)] * 127,
        [(-1) ** i * (i + 0.5) / 7.0 for i in range(128)],
    ], dtype=torch.float32)
    records = []
    for name in names:
        model = load_as_transformers(OUT / name, activations=False)
        config = json.loads((OUT / name / "config.json").read_text())["quantization_config"]
        if config["quant_method"] == "fp8":
            args = QuantizationArgs(**FP8_GROUP_ACTIVATIONS)
        else:
            args = QuantizationArgs(**next(iter(config["config_groups"].values()))["input_activations"])
        captured = {}
        def capture(layer):
            def hook(module, inputs):
                captured.setdefault(layer, inputs[0][0, :4].clone())  # the first 4 tokens
            return hook

        for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            model.get_submodule(layer).register_forward_pre_hook(capture(layer))
        with torch.no_grad():
            model(torch.tensor([CASES[1]]))
        for layer, x in list(captured.items()) + [("crafted", crafted)]:
            # As a layer sees it, (batch, tokens, columns): on a 2-D input compressed-tensors'
            # `token` strategy would reduce over the whole tensor.
            x3 = x.unsqueeze(0)
            scale, zero = compute_dynamic_scales_and_zp(value=x3, args=args, module=None)
            records.append({"fixture": name, "layer": layer, "args": args.model_dump(mode="json"),
                            "rows": x.shape[0], "cols": x.shape[1], "x": f32_hex(x),
                            "quantized": f32_hex(fake_quantize(x3, scale, zero, args)[0])})
    json.dump({"produced_by": "compressed-tensors compute_dynamic_scales_and_zp + fake_quantize", "records": records},
              open(OUT / "reference" / "input-quantization.json", "w"))


def write_static_variant(kind):
    """`tiny-KIND-w8a8-static`: the W8A8 directory with a static per-tensor input scale per
    layer (`input_activations` `strategy: tensor`, `dynamic: false`, `X.input_scale` [1] BF16),
    as llm-compressor writes calibrated INT8 checkpoints; each scale is `amax / 127` of the
    layer's inputs over the reference prompts (a calibration by hand: no data set here)."""
    from safetensors.torch import load_file, save_file

    src, out = OUT / f"tiny-{kind}-w8a8", OUT / f"tiny-{kind}-w8a8-static"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    (out / "recipe.yaml").unlink(missing_ok=True)  # llm-compressor's recipe was the dynamic one
    model = load_as_transformers(src, activations=False)
    amax = {}

    def observe(name):
        def hook(module, inputs):
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))
        return hook

    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in LINEARS:
            m.register_forward_pre_hook(observe(n))
    with torch.no_grad():
        for ids in CASES:
            model(torch.tensor([ids]))
    tensors = load_file(str(out / "model.safetensors"))
    for n, a in amax.items():
        tensors[f"{n}.input_scale"] = torch.tensor([a / 127.0], dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    activations = config["quantization_config"]["config_groups"]["group_0"]["input_activations"]
    activations.update(dynamic=False, strategy="tensor", observer="minmax")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_references(names, versions):
    """Recomputes every reference of `names` (directory names under OUT) by the real path."""
    (OUT / "reference" / "weights-only").mkdir(parents=True, exist_ok=True)
    for name in names:
        compute = ("float32, eager attention, as transformers loads the directory: dequantized weights, "
                   "each quantized layer's input quantized as the scheme says")
        ref = reference(load_as_transformers(OUT / name), name, versions, compute, every_position=True)
        json.dump(ref, open(OUT / "reference" / f"{name}.json", "w"))
        compute = "float32, eager attention, dequantized weights, activations not quantized"
        ref = reference(load_as_transformers(OUT / name, activations=False), name, versions, compute)
        json.dump(ref, open(OUT / "reference" / "weights-only" / f"{name}.json", "w"))
        print(f"{name}: references written")
    if len(names) > 1:
        record_input_quantization([f"tiny-qwen3-{suffix}" for suffix in ACTIVATION_QUANTIZED])


def main():
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    import compressed_tensors
    import llmcompressor
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "reference").mkdir(exist_ok=True)
    tok = tokenizer()
    versions = (f"transformers {transformers.__version__}, torch {torch.__version__}, "
                f"llm-compressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}")
    by_real_path = [f"tiny-{kind}-{suffix}" for kind in ("qwen3", "llama") for suffix in ACTIVATION_QUANTIZED]
    by_real_path.append("tiny-qwen3-w8a8-static")
    if "--static" in sys.argv:
        write_static_variant("qwen3")
        write_references(["tiny-qwen3-w8a8-static"], versions)
        return
    if "--references" in sys.argv:
        write_references(by_real_path, versions)
        return
    for kind in ("qwen3", "llama"):
        base = OUT / f"tiny-{kind}-bf16"
        shutil.rmtree(base, ignore_errors=True)
        model = base_model(kind)
        model.save_pretrained(base)
        tok.save_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        state = {k: v for k, v in model.state_dict().items()}
        json.dump(reference(float_copy(model, state), base.name, versions), open(OUT / "reference" / f"{base.name}.json", "w"))

        # compressed-tensors, by llm-compressor.
        for scheme in SCHEMES:
            name = f"tiny-{kind}-{scheme.lower().replace('_', '-')}"
            out = OUT / name
            shutil.rmtree(out, ignore_errors=True)
            m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            oneshot(model=m, tokenizer=tok, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
            m.save_pretrained(out, save_compressed=True)
            tok.save_pretrained(out)
            # transformers' own decompression of the directory is the reference's weights.
            loaded = AutoModelForCausalLM.from_pretrained(
                out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
            deq = {k: v for k, v in loaded.state_dict().items() if k in state}
            assert deq.keys() == state.keys(), sorted(set(state) ^ set(deq))
            # Cross-check one matrix against the stored integers and scales (per channel or group).
            stored = load_file(str(out / "model.safetensors"))
            p = "model.layers.0.mlp.down_proj"
            if f"{p}.weight" in stored and stored[f"{p}.weight"].dtype == torch.int8:
                s = stored[f"{p}.weight_scale"].float()
                manual = stored[f"{p}.weight"].float() * s
                assert torch.equal(manual, deq[f"{p}.weight"]), scheme
            json.dump(reference(float_copy(model, deq), name, versions), open(OUT / "reference" / f"{name}.json", "w"))

        # Qwen's fine-grained FP8, GPTQ v1 and AWQ GEMM, packed here.
        for fmt in ("fp8", "gptq", "awq"):
            name = f"tiny-{kind}-{fmt}"
            out = OUT / name
            shutil.rmtree(out, ignore_errors=True)
            tensors, deq = {}, {}
            for k, v in state.items():
                layer_linear = k.endswith(".weight") and any(f".{l}." in k for l in LINEARS)
                if not layer_linear:
                    tensors[k] = v.contiguous()
                    deq[k] = v.float()
                    continue
                prefix = k[: -len(".weight")]
                if fmt == "fp8":
                    q, s_inv, d = fp8_blocks(v)
                    tensors[f"{prefix}.weight"] = q
                    tensors[f"{prefix}.weight_scale_inv"] = s_inv
                    deq[k] = d
                    continue
                q, zero, scale = int4_groups(v)
                deq[k] = dequant_int4(q, zero, scale)
                if fmt == "gptq":
                    qweight, qzeros, scales, g_idx = pack_gptq(q, zero, scale)
                    uq, uz = unpack_gptq(qweight, qzeros)
                    tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros,
                                    f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx})
                else:
                    qweight, qzeros, scales = pack_awq(q, zero, scale)
                    uq, uz = unpack_awq(qweight, qzeros)
                    tensors.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
                assert torch.equal(uq, q) and torch.equal(uz, zero), (fmt, k)
            config = json.loads((base / "config.json").read_text())
            config["quantization_config"] = {
                "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                        "modules_to_not_convert": ["lm_head"]},
                "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False,
                         "checkpoint_format": "gptq", "true_sequential": True, "damp_percent": 0.01,
                         "static_groups": False, "lm_head": False},
                "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
                        "modules_to_not_convert": None},
            }[fmt]
            write_dir(out, tensors, config, tok)
            (out / "generation_config.json").write_text((base / "generation_config.json").read_text())
            json.dump(reference(float_copy(model, deq), name, versions), open(OUT / "reference" / f"{name}.json", "w"))
        print(f"{kind}: done")
    write_static_variant("qwen3")
    # The references of every scheme that quantizes activations, by transformers' real path.
    write_references(by_real_path, versions)


if __name__ == "__main__":
    main()
