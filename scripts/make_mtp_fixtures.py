"""Tiny Qwen3.5, Qwen3.5-MoE, Qwen3-Next and GLM-4.5 checkpoints with seeded
multi-token-prediction (MTP) heads, and what a float32 torch reference of the MTP proposer
computes on them.

GLM-4.5 (`tiny-glm4-moe-mtp`) publishes its head in DeepSeek-V3's NextN layout, one more decoder
layer `model.layers.{num_hidden_layers}.*` whose `eh_proj`, `enorm`, `hnorm` and
`shared_head.norm` are Qwen's `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden` and `norm`
(transformers 5's generic `MtpLayer` computes the same formula), with plain RMS norms and a
sparse `Glm4MoeDecoderLayer`; the layer's copies of the embedding and head are written too.

transformers does not run the MTP head (it ignores `mtp.*` on load), so the reference here is
built from transformers' own modules: one decoder layer of the family (a full-attention
`Qwen3_5DecoderLayer`, or a `Qwen3_5MoeDecoderLayer` or `Qwen3NextDecoderLayer` with its sparse
experts and sigmoid-gated shared expert), three `(1 + w)` RMS norms and the `fc` projection, run as
vLLM's `qwen3_next_mtp.py` and `qwen3_5_mtp.py` run them. The target models are text-only
(`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`), their weights seeded
random BF16 as in make_family_fixtures.py; the MTP tensors are added to `model.safetensors` under
the names and shapes Qwen publishes (the experts one tensor per expert), and `config.json` gets the
family's MTP layer count: `mtp_num_hidden_layers: 1` (Qwen3.5) or `num_nextn_predict_layers: 1`
(Qwen3-Next). Qwen3-Next's MTP layer has the experts even where the target's decoder_sparse_step
and mlp_only_layers would make a layer 0 dense.

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch transformers==5.24.0 safetensors
    /tmp/tvenv/bin/python scripts/make_mtp_fixtures.py tests/fixtures [NAME ...]

writes, for NAME in tiny-qwen3.5-mtp, tiny-qwen3.5-moe-mtp and tiny-qwen3-next-mtp (all of them,
or only the NAMEs given):

- OUT/families/fixtures/NAME: save_pretrained output plus the mtp.* tensors;
- OUT/families/reference/NAME.json: what transformers computes on the target (the format of
  make_family_fixtures.py: cases of 1, 9, 41 and 90 tokens with input_ids, argmax_per_position,
  greedy_new_ids and last_logits), so the family test walker covers the target;
- OUT/mtp/NAME.json: the MTP reference, cases of 1, 9 and 41 tokens, each with
  - input_ids (T ids) and next_token (the target's greedy token after them);
  - hidden: T rows, the target's final hidden states h_0..h_{T-1} (after its final norm), as
    float32 values written exactly, so that a test can run the head on transformers' own
    hidden states and compare the head alone;
  - teacher_forced_logits: T - 1 rows, row i the logits of the MTP row at position i whose
    inputs are the token input_ids[i + 1] and the target's final hidden state h_i (after the
    target's final norm), all rows in one causal pass;
  - chain_ids and chain_logits: the greedy chain of 4 proposals. Rows 0..T-2 are the teacher
    forced ones, row T-1 takes (next_token, h_{T-1}) and gives p1; row T-1+j (j >= 1) takes
    (p_j, y) where y is the MTP's own output at the previous row after mtp.norm, and gives
    p_{j+1}. Every row attends over all earlier MTP rows (the MTP's own keys and values) at its
    own RoPE position. chain_logits[j] is the row that gave p_{j+1}.

One MTP row, for position i, token t and hidden g (the embedding and the head are the target's):

    x = fc(cat([pre_fc_norm_embedding(embed_tokens(t)), pre_fc_norm_hidden(g)], -1))
    y = norm(layer(x, RoPE position i, causal over the MTP rows 0..i))
    logits = lm_head(y)

All compute is float32 with eager attention; the logits are rounded to 6 decimals.
"""
import copy, json, os, re, shutil, sys

import torch
from torch import nn
import transformers as T
from safetensors.torch import load_file, save_file
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as q35
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35moe
from transformers.models.qwen3_next import modeling_qwen3_next as q3n
from transformers.models.glm4_moe import modeling_glm4_moe as glm

out = sys.argv[1]
only = set(sys.argv[2:])
FIX, REF, MTP_REF = (os.path.join(out, "families", "fixtures"), os.path.join(out, "families", "reference"),
                     os.path.join(out, "mtp"))
for d in (FIX, REF, MTP_REF):
    os.makedirs(d, exist_ok=True)


def randomize(model, seed):
    """make_family_fixtures.py's rule: norms near 1 (the stored `(1 + w)` offsets 0.5..1.5),
    biases small, matrices scaled by 1.5 / sqrt(fan_in) so the logits are well separated."""
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


def randomize_router_biases(model, seed):
    """GLM's `e_score_correction_bias` is a buffer (randomize leaves it at zero): values of the
    sigmoids' own scale, so that the bias changes which experts are chosen."""
    g = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def run_cases(model, seqs, n_greedy=20):
    """make_family_fixtures.py's target reference, unchanged."""
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


class MTP(nn.Module):
    """The MTP head as Qwen publishes it (`mtp.*`): the submodules' names are the tensors'
    names. The decoder layer is built from a copy of the target's configuration whose only layer
    is a full-attention one (index 0), so that the layer is a full-attention layer of the family
    and a one-layer cache fits it."""

    def __init__(self, config, module):
        super().__init__()
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = 1
        if module is not glm:
            cfg.layer_types = ["full_attention"]
        else:
            # GLM-4.5's NextN layer is sparse (transformers' get_mtp_config sets
            # first_k_dense_replace = 0 for it, as vLLM's glm4_moe_mtp.py builds it).
            cfg.first_k_dense_replace = 0
        cfg._attn_implementation = "eager"
        if module is q3n:
            # Qwen3-Next's MTP layer is sparse whatever the target's decoder_sparse_step and
            # mlp_only_layers make of the target's layers (vLLM's qwen3_next_mtp.py builds it so):
            # in this copy, layer 0 must get the experts.
            cfg.mlp_only_layers = []
            cfg.decoder_sparse_step = 1
        self.config = cfg
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        rms, layer = {q35: (q35.Qwen3_5RMSNorm, q35.Qwen3_5DecoderLayer),
                      q35moe: (q35moe.Qwen3_5MoeRMSNorm, q35moe.Qwen3_5MoeDecoderLayer),
                      q3n: (q3n.Qwen3NextRMSNorm, q3n.Qwen3NextDecoderLayer),
                      glm: (glm.Glm4MoeRMSNorm, glm.Glm4MoeDecoderLayer)}[module]
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = rms(hidden, eps=eps)
        self.pre_fc_norm_hidden = rms(hidden, eps=eps)
        self.layers = nn.ModuleList([layer(cfg, layer_idx=0)])
        self.norm = rms(hidden, eps=eps)


def published_names(state, module, num_layers):
    """The MTP module's state under the names the checkpoint publishes: Qwen's `mtp.*` as the
    module names them; GLM-4.5's NextN layer as one more decoder layer, `model.layers.{L}.*`
    (L = num_hidden_layers) with `eh_proj`, `enorm`, `hnorm` and `shared_head.norm` beside the
    layer's own tensors."""
    if module is not glm:
        return {"mtp." + k: v for k, v in state.items()}
    renames = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "norm.": "shared_head.norm.", "layers.0.": ""}
    out = {}
    for k, v in state.items():
        for old, new in renames.items():
            if k.startswith(old):
                out[f"model.layers.{num_layers}.{new}{k[len(old):]}"] = v
                break
        else:
            raise ValueError(k)
    return out


def module_names(saved, module, num_layers):
    """published_names' inverse, over a checkpoint's tensors (the others dropped)."""
    if module is not glm:
        return {k[len("mtp."):]: v for k, v in saved.items() if k.startswith("mtp.")}
    prefix = f"model.layers.{num_layers}."
    renames = {"eh_proj.": "fc.", "enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.",
               "shared_head.norm.": "norm."}
    out = {}
    for k, v in saved.items():
        if not k.startswith(prefix):
            continue
        rest = k[len(prefix):]
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            continue  # copies of the target's embedding and head, as GLM publishes them
        for old, new in renames.items():
            if rest.startswith(old):
                out[new + rest[len(old):]] = v
                break
        else:
            out["layers.0." + rest] = v
    return out


def causal_mask(n):
    """The additive mask eager attention takes: [1, 1, n, n], -inf above the diagonal."""
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def layer_path(layer, rotary, x, start=0, cache=None):
    """One decoder layer over rows x [1, n, hidden] at positions start..start+n-1: the RoPE of the
    target's rotary module (2-D position ids; it broadcasts them to the three mRoPE axes itself),
    and a causal mask over the rows given (with a cache holding the earlier rows, one new row at
    a time needs no mask)."""
    n = x.shape[1]
    pos = torch.arange(start, start + n)[None]
    pe = rotary(x, pos)
    mask = causal_mask(n) if cache is None else None
    assert cache is None or n == 1
    return layer(x, position_embeddings=pe, attention_mask=mask, position_ids=pos, cache=cache)


def mtp_rows(mtp, target, tokens, hiddens, start=0, cache=None):
    """MTP rows for tokens [n] and hidden states [n, hidden] at positions start..: the output
    hidden states after mtp.norm [n, hidden] and the logits [n, vocab]."""
    e = target.model.embed_tokens(torch.tensor([tokens]))
    x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(hiddens[None])], -1))
    y = mtp.norm(layer_path(mtp.layers[0], target.model.rotary_emb, x, start, cache))
    return y[0], target.lm_head(y)[0]


def routing_gaps(mtp):
    """For the MoE head: a hook recording, for every row the MTP layer routes, the gap between the
    last chosen expert's router logit and the next one's (a near tie could route another way in
    another implementation)."""
    gaps = []
    router = getattr(mtp.layers[0].mlp, "gate", None)
    if router is None:
        return gaps, None
    def hook(module, args, out):
        choice = out[0]
        if hasattr(module, "e_score_correction_bias"):  # GLM: chosen by sigmoid + bias
            choice = choice.sigmoid() + module.e_score_correction_bias
        top = choice.topk(module.top_k + 1, dim=-1).values
        gaps.extend(float(v) for v in top[:, -2] - top[:, -1])
    return gaps, router.register_forward_hook(hook)


def mtp_case(mtp, target, ids, n_chain=4):
    with torch.no_grad():
        h = target.model(torch.tensor([ids])).last_hidden_state[0]
        logits = target(torch.tensor([ids])).logits[0]
        # The target's hidden state is after its final norm: the head over it gives its logits.
        assert torch.allclose(target.lm_head(h), logits, atol=1e-5)
        next_token = int(logits[-1].argmax())
        T_ = len(ids)
        # Teacher forced: rows 0..T-2 in one causal pass.
        if T_ > 1:
            _, teacher = mtp_rows(mtp, target, ids[1:], h[:-1])
        else:
            teacher = torch.zeros(0, target.config.vocab_size)
        # The chain, one row at a time through a cache of the MTP layer's keys and values (another
        # code path than the teacher forced pass: no mask, the keys and values of earlier rows
        # from the cache): the true rows first, then row T-1 on (next_token, h_{T-1}), then each
        # proposal on the MTP's own previous output.
        cache = DynamicCache(config=mtp.config)
        rows_tokens, rows_hidden = list(ids[1:]) + [next_token], list(h)
        row_logits = []
        for i in range(T_):
            y, lg = mtp_rows(mtp, target, [rows_tokens[i]], rows_hidden[i][None], i, cache)
            row_logits.append(lg[0])
        chain_ids, chain_logits, margins = [], [], []
        for j in range(n_chain):
            lg = row_logits[-1]
            top2 = lg.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            p = int(lg.argmax())
            chain_ids.append(p)
            chain_logits.append(lg)
            rows_tokens.append(p)
            rows_hidden.append(y[0])
            if j + 1 < n_chain:
                y, lg = mtp_rows(mtp, target, [p], y, T_ + j, cache)
                row_logits.append(lg[0])
        # Check 1: the two code paths agree on the teacher forced rows.
        if T_ > 1:
            diff = (torch.stack(row_logits[:T_ - 1]) - teacher).abs().max()
            assert diff < 1e-4, f"teacher forced vs cached rows: {diff}"
        # And a third: one causal pass over every chain row at once gives the same chain.
        n = T_ + n_chain - 1
        _, all_logits = mtp_rows(mtp, target, rows_tokens[:n], torch.stack(rows_hidden[:n]))
        diff = (all_logits[T_ - 1:] - torch.stack(chain_logits)).abs().max()
        assert diff < 1e-4, f"chain one pass vs cached: {diff}"
    case = {"input_ids": ids, "next_token": next_token,
            "hidden": [[float(v) for v in row] for row in h],
            "teacher_forced_logits": [[round(float(v), 6) for v in row] for row in teacher],
            "chain_ids": chain_ids,
            "chain_logits": [[round(float(v), 6) for v in row] for row in chain_logits]}
    target_margin = float(logits[-1].topk(2).values[0] - logits[-1].topk(2).values[1])
    return case, margins, target_margin


def check_layer_path(target):
    """Check 2: the layer path (the rotary module, the explicit mask, the layer's call) run on the
    target's own full-attention layer reproduces that layer inside the target's forward."""
    types = getattr(target.config, "layer_types", None)
    index = types.index("full_attention") if types else target.config.num_hidden_layers - 1
    layer = target.model.layers[index]
    seen = {}
    hook = layer.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0], y=out), with_kwargs=True)
    ids = torch.randint(0, target.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        target.model(ids)
        hook.remove()
        mine = layer_path(layer, target.model.rotary_emb, seen["x"])
    diff = (mine - seen["y"]).abs().max()
    assert diff < 1e-5, f"layer path vs the target's layer {index}: {diff}"


def per_expert(state):
    """The MTP state in the published layout: transformers holds the experts fused,
    `experts.gate_up_proj` [E, 2I, H] (gate rows first: its forward does
    `linear(x, gate_up_proj[e]).chunk(2, dim=-1)` -> gate, up) and `experts.down_proj` [E, H, I];
    Qwen publishes `experts.{e}.gate_proj.weight` [I, H], `up_proj` [I, H], `down_proj` [H, I]."""
    out = {}
    for k, v in state.items():
        prefix, _, leaf = k.rpartition("experts.")
        if not prefix or "." in leaf:
            out[k] = v
        elif leaf == "gate_up_proj":
            w = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = v[e, :w].contiguous()
                out[f"{prefix}experts.{e}.up_proj.weight"] = v[e, w:].contiguous()
        elif leaf == "down_proj":
            for e in range(v.shape[0]):
                out[f"{prefix}experts.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            raise ValueError(k)
    return out


def fused(state):
    """per_expert's inverse, to load the saved tensors back into transformers' module."""
    out, experts = {}, {}
    for k, v in state.items():
        m = re.match(r"(.*experts\.)(\d+)\.(gate|up|down)_proj\.weight", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in ids])
        out[prefix + "down_proj"] = torch.stack([by_expert[e]["down"] for e in ids])
    return out


BASE = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})

QWEN35_MTP = {"mtp_num_hidden_layers": 1}

# name -> (model class, config class, config kwargs, module of the MTP's layer and norms,
# seed of the target's weights, seed of the MTP's weights, keys set in config.json afterwards
# (None dropping one))
SPECS = {
    # The shared tiny-qwen3.5's configuration (three linear-attention layers, then one full).
    "tiny-qwen3.5-mtp": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", BASE, q35, 3737, 3738, QWEN35_MTP),
    # The same with 6 experts of width 48, top 2, and a shared expert of width 64 on every layer,
    # the MTP layer's too.
    "tiny-qwen3.5-moe-mtp": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig",
        dict(BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=64),
        q35moe, 3838, 3839, QWEN35_MTP),
    # make_family_fixtures.py's tiny-qwen3-next-gqa-sparse configuration (5 layers, full attention
    # every second one from `full_attention_interval` with layer_types left out of config.json,
    # experts of width 32, top 3 of 8 not renormalised, on every second layer but layer 3, a shared
    # expert of width 48 with its sigmoid gate, grouped linear-attention value heads), its weights
    # seeded anew, and Qwen3-Next's MTP field `num_nextn_predict_layers`. The MTP layer is a
    # full-attention Qwen3NextDecoderLayer with the sparse block (experts, shared expert and gate).
    "tiny-qwen3-next-mtp": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
        dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
             linear_value_head_dim=12, linear_conv_kernel_dim=3, num_experts=8, num_experts_per_tok=3,
             moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=False,
             decoder_sparse_step=2, mlp_only_layers=[3], full_attention_interval=2),
        q3n, 3939, 3940, {"layer_types": None, "full_attention_interval": 2, "num_nextn_predict_layers": 1}),
}

# GLM-4.5 (`Glm4MoeForCausalLM`, zai-org/GLM-4.5-Air's layout at a tiny size): q/k/v biases,
# per-head q/k norms, half the head rotated, the first layer dense, then 8 experts of width 32 in
# 2 groups (the top 1 group by its two best `sigmoid + e_score_correction_bias` kept, DeepSeek-V3's
# group-limited choice), top 3 weighed by the sigmoids renormalised and times 2.5, and one shared
# expert without a gate; its NextN layer (`num_nextn_predict_layers: 1`) is `model.layers.3.*`,
# with the copies of the embedding and head GLM publishes there.
GLM = dict(vocab_size=1024, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
           tie_word_embeddings=False, attention_bias=True, use_qk_norm=True, first_k_dense_replace=1,
           n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=1,
           n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
SPECS["tiny-glm4-moe-mtp"] = ("Glm4MoeForCausalLM", "Glm4MoeConfig", GLM, glm, 4141, 4142,
                              {"num_nextn_predict_layers": 1})

meta_base = "transformers " + T.__version__ + ", torch " + torch.__version__ + ", float32 compute, eager attention"
for name, (cls, cfg_cls, kw, module, seed, mtp_seed, config_edits) in SPECS.items():
    if only and name not in only:
        continue
    torch.manual_seed(0)
    cfg = getattr(T, cfg_cls)(**kw)
    cfg.dtype = "bfloat16"
    model = getattr(T, cls)(cfg)
    randomize(model, seed)
    randomize_router_biases(model, seed)
    d = os.path.join(FIX, name)
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    path = os.path.join(d, "config.json")
    config = json.load(open(path))
    for k, v in config_edits.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    json.dump(config, open(path, "w"), indent=2, sort_keys=True)

    # The MTP head: randomized in float32, stored in BF16 with the prefix `mtp.`, the experts
    # one tensor per expert.
    mtp = MTP(cfg, module)
    randomize(mtp, mtp_seed)
    randomize_router_biases(mtp, mtp_seed)
    state = per_expert(published_names({k: v.to(torch.bfloat16) for k, v in mtp.state_dict().items()}, module,
                                       cfg.num_hidden_layers))
    path = os.path.join(d, "model.safetensors")
    tensors = load_file(path)
    assert not set(state) & set(tensors)
    if module is glm:
        # GLM publishes copies of the embedding and the head in its NextN layer.
        prefix = f"model.layers.{cfg.num_hidden_layers}."
        state[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        state[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        # The routers' selection biases in float32, as GLM publishes them.
        for k in list(tensors) + list(state):
            if k.endswith("e_score_correction_bias"):
                src = tensors if k in tensors else state
                src[k] = src[k].float()
    tensors.update(state)
    save_file(tensors, path, metadata={"format": "pt"})

    # The reference reads back what was written: the target through transformers (which ignores
    # mtp.*), the MTP head from the file into a fresh float32 module (strictly: every tensor of
    # the module and no other).
    target, info = getattr(T, cls).from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                   output_loading_info=True)
    target.eval()
    assert not info["missing_keys"], info
    mtp = MTP(target.config, module).eval()
    saved = {k: v.float() for k, v in module_names(load_file(path), module, target.config.num_hidden_layers).items()}
    mtp.load_state_dict(fused(saved), strict=True)
    check_layer_path(target)

    g = torch.Generator().manual_seed(4321)
    seqs = [[int(t) for t in torch.randint(0, 1024, (n,), generator=g)] for n in (1, 9, 41, 90)]
    meta = {"model": name, "architecture": cls, "produced_by": meta_base, "dtype_on_disk": "bfloat16"}
    json.dump({**meta, "cases": run_cases(target, seqs)}, open(os.path.join(REF, name + ".json"), "w"))

    g = torch.Generator().manual_seed(2468)
    cases = []
    for n in (1, 9, 41):
        ids = [int(t) for t in torch.randint(0, 1024, (n,), generator=g)]
        gaps, hook = routing_gaps(mtp)
        case, margins, target_margin = mtp_case(mtp, target, ids)
        if hook is not None:
            hook.remove()
        # Check 3: every greedy choice is well separated (Kylin must make the same choices), and
        # so is every choice of experts in the MTP layer.
        assert min(margins + [target_margin]) >= 1e-3, (name, n, margins, target_margin)
        assert not gaps or min(gaps) >= 1e-3, (name, n, min(gaps))
        print(f"{name} T={n}: next_token {case['next_token']} (top-2 margin {target_margin:.4f}), "
              f"chain {case['chain_ids']} (margins {', '.join(f'{m:.4f}' for m in margins)})"
              + (f", smallest routing gap {min(gaps):.4f}" if gaps else ""))
        cases.append(case)
    meta = {"model": name, "architecture": cls, "produced_by": meta_base + " (the MTP head: scripts/make_mtp_fixtures.py)",
            "dtype_on_disk": "bfloat16", "mtp_layers": 1}
    json.dump({**meta, "cases": cases}, open(os.path.join(MTP_REF, name + ".json"), "w"))
    print(f"{name}: ok ({cls}, {len(state)} mtp tensors)")
