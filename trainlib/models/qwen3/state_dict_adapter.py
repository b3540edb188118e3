"""Hugging Face Qwen3 <-> trainlib Qwen3: parameter names and the model
config. Pure functions over plain tensors and dicts (no files, no process
group), with the same functions, signatures and meanings as
`trainlib.models.llama3.state_dict_adapter`, so the file reader/writer
(`trainlib.checkpoint.hf`) can take either family's adapter.

Names: HF `model.layers.3.self_attn.q_proj.weight` is trainlib
`layers.3.attention.wq.weight`, `...self_attn.q_norm.weight` is
`layers.3.attention.q_norm.weight`, and so on (`LAYER_NAMES`).

Layout: none to convert. trainlib's Qwen3 rotates the two halves of each head
as HF's `rotate_half` does, so every tensor is stored as it is in both;
`hf_row_order` is None for every weight.
"""

from __future__ import annotations

import torch

from trainlib.errors import ConfigError
from trainlib.models.qwen3.model import ModelArgs

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPE = "qwen3"

LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_FROM_HF_LAYER = {theirs: ours for ours, theirs in LAYER_NAMES.items()}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_FROM_HF_TOP = {theirs: ours for ours, theirs in TOP_NAMES.items()}


def to_hf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, idx, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{idx}.{LAYER_NAMES[rest]}"


def from_hf_name(name: str) -> str | None:
    if name in _FROM_HF_TOP:
        return _FROM_HF_TOP[name]
    parts = name.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _FROM_HF_LAYER:
        return f"layers.{parts[2]}.{_FROM_HF_LAYER[parts[3]]}"
    return None  # not a model weight (e.g. rotary inv_freq buffers of old exports)


# --------------------------------------------------------------------------- config


def _sliding_layers(cfg: dict) -> list[int]:
    """The layers an HF Qwen3 config gives sliding-window attention: those
    `layer_types` names so, or, in configs without it, layers from
    `max_window_layers` on when `use_sliding_window` is set (transformers'
    rule)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        return list(range(cfg.get("max_window_layers", 28), n))
    return []


def args_from_hf_config(cfg: dict) -> ModelArgs:
    return ModelArgs(**hf_attention_args(cfg, "Qwen3", MODEL_TYPE, ARCHITECTURES))


def hf_attention_args(cfg: dict, family: str, model_type: str, architectures) -> dict:
    """What a Qwen3-style HF config.json says of the args Qwen3's families share (widths, heads, RoPE,
    vocabulary, norms, tied embeddings), after refusing in one line what trainlib's Qwen3 attention cannot
    run: another model type, projection biases, sliding windows, another activation, scaled RoPE."""
    got_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if (got_type is not None and got_type != model_type) or (archs and not set(archs) & set(architectures)):
        raise ConfigError(f"HF config has model_type={got_type!r} architectures={archs}, not {family}'s "
                          f"({model_type!r}, {architectures[0]}): set model.name to the family of that "
                          "checkpoint")
    if cfg.get("attention_bias"):
        raise ConfigError(f"HF config has attention_bias=true, but trainlib's {family} projections have no bias: "
                          "this checkpoint cannot be imported")
    sliding = _sliding_layers(cfg)
    if sliding:
        raise ConfigError(f"HF config gives {len(sliding)} layer(s) sliding-window attention "
                          f"(sliding_window={cfg.get('sliding_window')}, from layer {sliding[0]}), but trainlib's "
                          f"{family} attends causally to the whole window: this checkpoint cannot be imported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"HF config has hidden_act={cfg['hidden_act']!r}, but trainlib's {family} MLP is SwiGLU "
                          "(silu): this checkpoint cannot be imported")
    # transformers 5 nests the rotary settings in `rope_parameters`; older
    # configs (all the published Qwen3 ones) give `rope_theta` and `rope_scaling`.
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"HF config has rope_type={rope_type!r}, but trainlib's {family} implements unscaled "
                          "RoPE only: remove rope_scaling from config.json to import the weights at their "
                          "native context length")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))  # transformers' default when unstated
    return dict(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), max_seq_len=int(cfg.get("max_position_embeddings", 32768)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict:
    # Written as the published Qwen3 config.json files are (rope_theta at the
    # top level): transformers 4.51+ and 5.x both read it.
    return {
        "architectures": list(ARCHITECTURES), "model_type": MODEL_TYPE, "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": None, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


# --------------------------------------------------------------------------- weights


def hf_weight_names(hf_names, args: ModelArgs) -> dict[str, str]:
    """trainlib name -> HF name of every model weight among `hf_names`
    (anything else is left out). Tied, the embedding serves as
    `output.weight` too, as transformers ties them, whether or not the
    folder also stores an `lm_head.weight`; untied, a missing lm_head stays
    missing for the caller to report."""
    names = {}
    for name in hf_names:
        ours = from_hf_name(name)
        if ours is not None:
            names[ours] = name
    if args.tie_embeddings and "tok_embeddings.weight" in names:
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def hf_row_order(ours: str, args: ModelArgs) -> torch.Tensor | None:
    """None: HF stores every Qwen3 weight in trainlib's row order (both rotate
    the two halves of each head)."""
    return None


def hf_weight_to_trainlib(ours: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The HF tensor of trainlib weight `ours` in trainlib's layout: the same."""
    return t


def trainlib_weight_names(names, args: ModelArgs) -> dict[str, str]:
    """HF name of every trainlib weight among `names` that an HF folder
    stores: a tied model stores one matrix, the embedding."""
    return {name: to_hf_name(name) for name in names if not (name == "output.weight" and args.tie_embeddings)}


def trainlib_weight_to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Trainlib weight `name` in HF's layout: the same."""
    return t
