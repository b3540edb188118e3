"""Hugging Face Qwen3-MoE <-> trainlib Qwen3-MoE: parameter names and the model
config. Pure functions over plain tensors and dicts (no files, no process
group), with the same functions, signatures and meanings as
`trainlib.models.qwen3.state_dict_adapter`, so the file reader/writer
(`trainlib.checkpoint.hf`) takes this family's adapter as it takes theirs.

Names, as the hub's checkpoints store them (`Qwen/Qwen3-30B-A3B`; transformers
5 fuses the experts in memory, `mlp.experts.gate_up_proj`, but its
save_pretrained writes this per-expert format back):
  attention and norms       as Qwen3 dense (`model.layers.N.self_attn.q_proj.weight` is
                            `layers.N.attention.wq.weight`, ...)
  router                    `model.layers.N.mlp.gate.weight` [E, dim] is `layers.N.moe.router.gate.weight`
  experts                   `model.layers.N.mlp.experts.<e>.gate_proj.weight` [expert_dim, dim] is
                            `layers.N.moe.experts.w1[e]` (w1: [E, expert_dim, dim]), `up_proj` is `w3[e]`,
                            `down_proj` [dim, expert_dim] is `w2[e]` (w2: [E, dim, expert_dim])
  dense first blocks        `model.layers.N.mlp.gate_proj/up_proj/down_proj.weight` is
                            `layers.N.feed_forward.w1/w3/w2.weight` (HF: `mlp_only_layers`)
One trainlib experts weight is E HF tensors: `hf_weight_names` and
`trainlib_weight_names` name it by the tuple of its experts' HF names, in expert
order, and the reader stacks them on a new first dimension, the writer splits
it (`trainlib.checkpoint.hf`). `layers.N.moe.expert_bias` (the load-balance
bias, a buffer) has no HF counterpart: it is not exported, and an imported
model starts it at zero.

Layout: none to convert (rotate-half RoPE in both, as Qwen3 dense).
"""

from __future__ import annotations

import re

import torch

from trainlib.errors import ConfigError
from trainlib.blocks.moe import MoEArgs
from trainlib.models.qwen3.state_dict_adapter import LAYER_NAMES, TOP_NAMES, hf_attention_args
from trainlib.models.qwen3_moe.model import ModelArgs

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPE = "qwen3_moe"

# Qwen3's (attention with QK-norm, norms, the dense blocks' MLP) and the MoE blocks' router
_LAYER_NAMES = {**LAYER_NAMES, "moe.router.gate.weight": "mlp.gate.weight"}
_FROM_HF_LAYER = {theirs: ours for ours, theirs in _LAYER_NAMES.items()}
# trainlib's stacked experts weight -> each expert's HF projection
_EXPERT_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w3": "up_proj", "moe.experts.w2": "down_proj"}
_FROM_HF_EXPERT = {theirs: ours for ours, theirs in _EXPERT_NAMES.items()}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_NO_HF = ("moe.expert_bias", "moe.expert_load")  # trainlib-only state (the load-balance buffers)
_FROM_HF_TOP = {theirs: ours for ours, theirs in TOP_NAMES.items()}


def to_hf_name(name: str) -> str:
    """The HF name of trainlib weight `name`; a stacked experts weight gives its experts' names with `*`
    for the expert index (`model.layers.3.mlp.experts.*.gate_proj.weight`)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, idx, rest = name.split(".", 2)  # layers.<i>.<rest>
    if rest in _EXPERT_NAMES:
        return f"model.layers.{idx}.mlp.experts.*.{_EXPERT_NAMES[rest]}.weight"
    return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"


def from_hf_name(name: str) -> str | None:
    """The trainlib weight HF weight `name` is (an expert's projection: the stacked weight it is a slice of),
    or None for what is not a model weight."""
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    expert = _HF_EXPERT.fullmatch(name)
    if expert:
        ours = _FROM_HF_EXPERT.get(expert.group(3))
        return f"layers.{expert.group(1)}.{ours}" if ours else None
    parts = name.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _FROM_HF_LAYER:
        return f"layers.{parts[2]}.{_FROM_HF_LAYER[parts[3]]}"
    return None  # not a model weight (e.g. rotary inv_freq buffers of old exports)


def _expert_names(name: str, n_experts: int) -> tuple[str, ...]:
    return tuple(to_hf_name(name).replace("*", str(e)) for e in range(n_experts))


# --------------------------------------------------------------------------- config


def _dense_layers(cfg: dict, n_experts: int) -> list[int]:
    """The layers an HF Qwen3-MoE config gives a dense MLP (transformers' rule): those in
    `mlp_only_layers`, and those `decoder_sparse_step` skips (layer i is sparse when (i + 1) % step == 0)."""
    only = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step") or 1
    return [i for i in range(cfg["num_hidden_layers"])
            if i in only or not (n_experts > 0 and (i + 1) % step == 0)]


def args_from_hf_config(cfg: dict) -> ModelArgs:
    shared = hf_attention_args(cfg, "Qwen3-MoE", MODEL_TYPE, ARCHITECTURES)
    if not cfg.get("norm_topk_prob", False):
        raise ConfigError(f"HF config has norm_topk_prob={cfg.get('norm_topk_prob', False)!r}, but trainlib's "
                          "Qwen3-MoE renormalises the chosen experts' weights to sum to 1 (every published "
                          "Qwen3-MoE sets it true): this checkpoint cannot be imported")
    # transformers 5 writes the expert count as num_local_experts (num_experts is its alias); the hub's as num_experts
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not n_experts:
        raise ConfigError(f"HF config has num_experts={n_experts!r}: a Qwen3-MoE without experts is a dense "
                          "Qwen3; import it as model.name = 'qwen3'")
    dense = _dense_layers(cfg, n_experts)
    if dense != list(range(len(dense))):
        raise ConfigError(f"HF config makes layer(s) {dense} dense (mlp_only_layers={cfg.get('mlp_only_layers')}, "
                          f"decoder_sparse_step={cfg.get('decoder_sparse_step')}), but trainlib's Qwen3-MoE has its "
                          "dense blocks first (n_dense_layers): this checkpoint cannot be imported")
    return ModelArgs(**shared, n_dense_layers=len(dense),
                     moe=MoEArgs(n_experts=n_experts, top_k=cfg["num_experts_per_tok"],
                                 expert_dim=cfg["moe_intermediate_size"]))


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict:
    """Written as the published Qwen3-MoE config.json files are (num_experts, rope_theta at the top level):
    transformers 4.51+ and 5.x read it. Args HF's Qwen3-MoE cannot express are refused in one line."""
    m = args.moe
    for what, value, hf in (("n_shared_experts", m.n_shared_experts, 0), ("score_func", m.score_func, "softmax"),
                            ("route_norm", m.route_norm, True), ("route_scale", m.route_scale, 1.0),
                            ("n_groups", m.n_groups, 1)):
        if value != hf:
            raise ConfigError(f"model.moe {what}={value!r}, but Hugging Face's Qwen3-MoE has {what}={hf!r} only: "
                              "this model cannot be exported to its format")
    return {
        "architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE, "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "num_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.expert_dim,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": list(range(args.n_dense_layers)),
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": None, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers,
        "output_router_logits": False, "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


# --------------------------------------------------------------------------- weights


def hf_weight_names(hf_names, args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
    """trainlib name -> HF name of every model weight among `hf_names`
    (anything else is left out); a stacked experts weight -> the tuple of its
    n_experts HF names, in expert order, when `hf_names` holds all of them
    (else it is left out, for the caller to report as missing). Tied, the
    embedding serves as `output.weight` too, as transformers ties them."""
    names: dict[str, str | tuple[str, ...]] = {}
    experts: dict[str, set[str]] = {}
    for name in hf_names:
        ours = from_hf_name(name)
        if ours is None:
            continue
        if _HF_EXPERT.fullmatch(name):
            experts.setdefault(ours, set()).add(name)
        else:
            names[ours] = name
    for ours, found in experts.items():
        want = _expert_names(ours, args.moe.n_experts)
        if found.issuperset(want):
            names[ours] = want
    if args.tie_embeddings and "tok_embeddings.weight" in names:
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def hf_row_order(ours: str, args: ModelArgs) -> torch.Tensor | None:
    """None: HF stores every Qwen3-MoE weight in trainlib's row order (experts stacked in expert order)."""
    return None


def hf_weight_to_trainlib(ours: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The HF tensor of trainlib weight `ours` (an experts weight: its experts' tensors stacked in order)
    in trainlib's layout: the same."""
    return t


def trainlib_weight_names(names, args: ModelArgs) -> dict[str, str | tuple[str, ...]]:
    """HF name of every trainlib weight among `names` that an HF folder
    stores (a stacked experts weight: the tuple of its experts' names, split
    from its first dimension in that order): a tied model stores one matrix,
    the embedding; the load-balance bias is not stored."""
    out: dict[str, str | tuple[str, ...]] = {}
    for name in names:
        if (name == "output.weight" and args.tie_embeddings) or name.endswith(_NO_HF):
            continue
        rest = name.split(".", 2)[2] if name.startswith("layers.") else None
        out[name] = _expert_names(name, args.moe.n_experts) if rest in _EXPERT_NAMES else to_hf_name(name)
    return out


def trainlib_weight_to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Trainlib weight `name` in HF's layout: the same (an experts weight is split into its experts by the
    writer)."""
    return t
