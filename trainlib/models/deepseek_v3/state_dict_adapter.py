"""Hugging Face DeepSeek-V3 <-> trainlib DeepSeek-V3: parameter names and the model config. Pure functions
over plain tensors and dicts (no files, no process group), with the same functions, signatures and meanings
as `trainlib.models.qwen3_moe.state_dict_adapter`, so the file reader/writer (`trainlib.checkpoint.hf`)
takes this family's adapter as it takes theirs.

Names, as the hub's checkpoints store them (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-*; transformers 5
fuses the experts in memory, `mlp.experts.gate_up_proj` [E, 2 * I, H], but reads and writes this
per-expert format):
  attention     `model.layers.N.self_attn.` q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa,
                kv_a_layernorm, kv_b_proj, o_proj are `layers.N.attention.` wq (or wq_a, q_norm, wq_b), wkv_a,
                kv_norm, wkv_b, wo
  norms         input_layernorm / post_attention_layernorm are attention_norm / ffn_norm
  dense blocks  `mlp.gate_proj/up_proj/down_proj` are `feed_forward.w1/w3/w2`
  MoE blocks    `mlp.gate.weight` is `moe.router.gate.weight`, `mlp.gate.e_score_correction_bias` the
                aux-free bias `moe.expert_bias` (a buffer: imported and exported), `mlp.shared_experts.*` are
                `moe.shared_experts.w1/w3/w2`, `mlp.experts.<e>.gate_proj/up_proj/down_proj.weight` are
                `moe.experts.w1/w3/w2[e]` (stacked: named by the tuple of their HF names, in expert order)
  MTP depth k   `model.layers.{n_layers + k}.` enorm, hnorm, eh_proj, shared_head.norm are `mtp.k.` enorm,
                hnorm, eh_proj, norm; that layer's decoder-block names are `mtp.k.transformer_layer.*`; its
                `embed_tokens` and `shared_head.head` are the main model's embedding and output head (one
                tensor each here: read from the main names, written under both)
Layout: none to convert (transformers' rope_interleave convention is the model's own, model.py).
Float8 hub weights (a `weight_scale_inv` per 128 x 128 block) are dequantized by the reader
(trainlib.checkpoint.hf); `expert_load` (trainlib-only state) is not exported.
"""

from __future__ import annotations

import re

import torch

from trainlib.blocks.moe import MoEArgs
from trainlib.errors import ConfigError
from trainlib.models.deepseek_v3.model import ModelArgs

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPE = "deepseek_v3"

# block names: trainlib (relative to a block) -> HF (relative to model.layers.N)
LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_FROM_HF_LAYER = {theirs: ours for ours, theirs in LAYER_NAMES.items()}
# an MTP module's own names (relative to mtp.<k> and model.layers.{n_layers + k})
MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "norm.weight": "shared_head.norm.weight"}
_FROM_HF_MTP = {theirs: ours for ours, theirs in MTP_NAMES.items()}
# the main model's weights an MTP layer of the hub stores again
MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_FROM_HF_TOP = {theirs: ours for ours, theirs in TOP_NAMES.items()}
_EXPERT_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_FROM_HF_EXPERT = {theirs: ours for ours, theirs in _EXPERT_NAMES.items()}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_NO_HF = ("moe.expert_load",)  # trainlib-only state


def _block_prefix(name: str, n_layers: int) -> tuple[str, str]:
    """(HF prefix, rest) of a trainlib block weight: `layers.<i>.<rest>` or `mtp.<k>.transformer_layer.<rest>`."""
    if name.startswith("layers."):
        _, idx, rest = name.split(".", 2)
        return f"model.layers.{idx}.", rest
    _, k, _, rest = name.split(".", 3)  # mtp.<k>.transformer_layer.<rest>
    return f"model.layers.{n_layers + int(k)}.", rest


def to_hf_name(name: str, n_layers: int) -> str:
    """The HF name of trainlib weight `name`; a stacked experts weight gives its experts' names with `*` for
    the expert index (`model.layers.3.mlp.experts.*.gate_proj.weight`)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if name.startswith("mtp.") and ".transformer_layer." not in name:
        _, k, rest = name.split(".", 2)
        return f"model.layers.{n_layers + int(k)}.{MTP_NAMES[rest]}"
    prefix, rest = _block_prefix(name, n_layers)
    if rest in _EXPERT_NAMES:
        return f"{prefix}mlp.experts.*.{_EXPERT_NAMES[rest]}.weight"
    return prefix + LAYER_NAMES[rest]


def _ours_of_layer(index: int, rest: str, n_layers: int) -> str:
    """trainlib name of `rest` (trainlib's, relative to a block) in HF layer `index`."""
    if index < n_layers:
        return f"layers.{index}.{rest}"
    return f"mtp.{index - n_layers}.transformer_layer.{rest}"


def from_hf_name(name: str, n_layers: int) -> str | None:
    """The trainlib weight HF weight `name` is (an expert's projection: the stacked weight it is a slice of),
    or None for what is not a model weight here (an MTP layer's copies of the embedding and head, the
    float8 scales, rotary buffers)."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    expert = _HF_EXPERT.fullmatch(name)
    if expert:
        ours = _FROM_HF_EXPERT.get(expert.group(3))
        return _ours_of_layer(int(expert.group(1)), ours, n_layers) if ours else None
    parts = name.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    index, rest = int(parts[2]), parts[3]
    if index >= n_layers and rest in _FROM_HF_MTP:
        return f"mtp.{index - n_layers}.{_FROM_HF_MTP[rest]}"
    if rest in _FROM_HF_LAYER:
        return _ours_of_layer(index, _FROM_HF_LAYER[rest], n_layers)
    return None


def _expert_names(name: str, args: ModelArgs) -> tuple[str, ...]:
    return tuple(to_hf_name(name, args.n_layers).replace("*", str(e)) for e in range(args.moe.n_experts))


# --------------------------------------------------------------------------- config


def _refuse(what: str, value, why: str) -> ConfigError:
    return ConfigError(f"HF config has {what}={value!r}, but {why}: this checkpoint cannot be imported")


def _rope(cfg: dict) -> dict:
    """RoPE settings from transformers 5's `rope_parameters` or the hub's `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return {"rope_theta": theta}
    if kind != "yarn":
        raise _refuse("rope type", kind, "trainlib's DeepSeek-V3 has plain RoPE or YaRN only")
    if params.get("attention_factor") is not None:
        raise _refuse("rope attention_factor", params["attention_factor"],
                      "trainlib's DeepSeek-V3 derives it from mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        raise _refuse("rope truncate", params["truncate"], "trainlib's DeepSeek-V3 truncates YaRN's correction range")
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    return {"rope_theta": theta, "rope_factor": float(factor), "original_seq_len": int(original),
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "mscale": float(params.get("mscale") or 0.0), "mscale_all_dim": float(params.get("mscale_all_dim") or 0.0)}


def args_from_hf_config(cfg: dict) -> ModelArgs:
    archs = cfg.get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise ConfigError(f"HF config is a {archs} model, not DeepSeek-V3 ({', '.join(ARCHITECTURES)})")
    for key, want, why in (("hidden_act", "silu", "its experts are SwiGLU"),
                           ("attention_bias", False, "its projections have no bias"),
                           ("rope_interleave", True, "its RoPE is transformers' interleaved convention"),
                           ("moe_layer_freq", 1, "every block after the dense ones is MoE"),
                           ("scoring_func", "sigmoid", "its router scores are sigmoids (transformers' too)"),
                           ("topk_method", "noaux_tc", "it routes by group-limited top-k with the bias")):
        if cfg.get(key, want) != want:
            raise _refuse(key, cfg[key], f"trainlib's DeepSeek-V3 needs {want!r} ({why})")
    n_heads = cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads", n_heads) != n_heads:
        raise _refuse("num_key_value_heads", cfg["num_key_value_heads"], "MLA has one key and value per head")
    n_groups = cfg.get("n_group") or 1
    return ModelArgs(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads, vocab_size=cfg["vocab_size"],
        ffn_dim=cfg["intermediate_size"], n_dense_layers=cfg.get("first_k_dense_replace", 0),
        q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_seq_len=cfg["max_position_embeddings"], tie_embeddings=cfg.get("tie_word_embeddings", False),
        mtp_depth=cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0)) or 0, **_rope(cfg),
        moe=MoEArgs(n_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                    expert_dim=cfg["moe_intermediate_size"], n_shared_experts=cfg.get("n_shared_experts") or 0,
                    score_func="sigmoid", route_norm=bool(cfg.get("norm_topk_prob", True)),
                    route_scale=float(cfg.get("routed_scaling_factor", 1.0)), n_groups=n_groups,
                    topk_groups=cfg.get("topk_group") or 1, group_score="top2_sum"),
    )


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict:
    """Written as transformers 5 writes a DeepseekV3Config (rope settings in `rope_parameters`); the MTP depth
    as the hub's num_nextn_predict_layers. Args HF's DeepSeek-V3 cannot express are refused in one line."""
    m = args.moe
    for what, value, hf in (("score_func", m.score_func, "sigmoid"),
                            ("group_score", m.group_score if m.n_groups > 1 else "top2_sum", "top2_sum")):
        if value != hf:
            raise ConfigError(f"model.moe {what}={value!r}, but Hugging Face's DeepSeek-V3 has {what}={hf!r} only: "
                              "this model cannot be exported to its format")
    rope: dict = {"rope_theta": args.rope_theta, "rope_type": "default"}
    if args.rope_factor > 1:
        rope.update(rope_type="yarn", factor=args.rope_factor, original_max_position_embeddings=args.original_seq_len,
                    beta_fast=args.beta_fast, beta_slow=args.beta_slow)
        rope.update({k: getattr(args, k) for k in ("mscale", "mscale_all_dim") if getattr(args, k)})
    return {
        "architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE, "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads, "vocab_size": args.vocab_size,
        "q_lora_rank": args.q_lora_rank or None, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "first_k_dense_replace": args.n_dense_layers,
        "n_routed_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_dim,
        "n_shared_experts": m.n_shared_experts, "routed_scaling_factor": m.route_scale, "norm_topk_prob": m.route_norm,
        "n_group": m.n_groups, "topk_group": m.topk_groups, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rms_norm_eps": args.norm_eps, "rope_parameters": rope, "rope_interleave": True,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": args.tie_embeddings,
        "num_nextn_predict_layers": args.mtp_depth, "attention_bias": False, "attention_dropout": 0.0,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


# --------------------------------------------------------------------------- weights


def hf_weight_names(hf_names, args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
    """trainlib name -> HF name of every model weight among `hf_names` (anything else is left out); a stacked
    experts weight -> the tuple of its n_experts HF names, in expert order, when `hf_names` holds all of them
    (else it is left out, for the caller to report as missing). Tied, the embedding serves as
    `output.weight` too. MTP layers beyond args.mtp_depth are not model weights of this shape."""
    names: dict[str, str | tuple[str, ...]] = {}
    experts: dict[str, set[str]] = {}
    for name in hf_names:
        ours = from_hf_name(name, args.n_layers)
        if ours is None or (ours.startswith("mtp.") and int(ours.split(".")[1]) >= args.mtp_depth):
            continue
        if _HF_EXPERT.fullmatch(name):
            experts.setdefault(ours, set()).add(name)
        else:
            names[ours] = name
    for ours, found in experts.items():
        want = _expert_names(ours, args)
        if found.issuperset(want):
            names[ours] = want
    if args.tie_embeddings and "tok_embeddings.weight" in names:
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def hf_row_order(ours: str, args: ModelArgs) -> torch.Tensor | None:
    """None: HF stores every DeepSeek-V3 weight in trainlib's row order."""
    return None


def hf_weight_to_trainlib(ours: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The HF tensor of trainlib weight `ours` in trainlib's layout: the same."""
    return t


def trainlib_weight_names(names, args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
    """HF name of every trainlib weight among `names` that an HF folder stores (a stacked experts weight: the
    tuple of its experts' names). The copies of the embedding and output head each MTP layer holds are
    `hf_weight_copies`'."""
    out: dict[str, str | tuple[str, ...]] = {}
    for name in names:
        if (name == "output.weight" and args.tie_embeddings) or name.endswith(_NO_HF):
            continue
        block = name.startswith("layers.") or ".transformer_layer." in name
        rest = _block_prefix(name, args.n_layers)[1] if block else None
        out[name] = _expert_names(name, args) if rest in _EXPERT_NAMES else to_hf_name(name, args.n_layers)
    return out


def trainlib_weight_to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Trainlib weight `name` in HF's layout: the same (an experts weight is split into its experts by the
    writer)."""
    return t


def hf_weight_copies(args: ModelArgs) -> dict[str, list[str]]:
    """trainlib name -> the further HF names the writer stores the same tensor under (trainlib.checkpoint.hf):
    each MTP layer's `embed_tokens` and `shared_head.head`, the main model's embedding and output head, as
    the hub's checkpoints hold them. The reader ignores those copies (`from_hf_name`)."""
    out: dict[str, list[str]] = {}
    for k in range(args.mtp_depth):
        for theirs, ours in MTP_SHARED.items():
            out.setdefault(ours, []).append(f"model.layers.{args.n_layers + k}.{theirs}")
    return out
