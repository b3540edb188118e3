"""Hugging Face Llama <-> trainlib Llama: parameter names, the rotary layout
of wq/wk, and the model config. Pure functions over plain tensors and dicts
(no files, no process group); `trainlib.checkpoint.hf` reads and writes the
files with them. The model registry (`trainlib.models.registry`) points at
this module as the llama3 family's state-dict adapter.

Names: HF `model.layers.3.self_attn.q_proj.weight` is trainlib
`layers.3.attention.wq.weight`, and so on (`_LAYER_NAMES`).

Rotary layout: trainlib (like Meta's reference code) rotates adjacent pairs
(x0, x1), (x2, x3), ... of each head; HF's `rotate_half` rotates (x_i, x_{i+d/2}).
The two give the same attention scores when the rows of wq and wk inside each
head are permuted: HF's layout lists the pairs' first rows, then their second
rows. `_meta_to_hf` / `_hf_to_meta` apply that permutation (and its inverse).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from trainlib.errors import ConfigError
from trainlib.models.llama3.model import ModelArgs

# config.json `architectures` this family reads (trainlib.checkpoint.hf picks the family by them).
ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPE = "llama"

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    _, idx, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"


def from_hf_name(name: str) -> str | None:
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    if name.startswith("model.layers."):
        _, _, idx, rest = name.split(".", 3)
        for ours, theirs in _LAYER_NAMES.items():
            if rest == theirs:
                return f"layers.{idx}.{ours}"
    return None  # e.g. rotary inv_freq buffers in old exports


def _meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------- config


def args_from_hf_config(cfg: dict) -> ModelArgs:
    archs = cfg.get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise ConfigError(f"HF config of architecture {archs} is not a Llama ({', '.join(ARCHITECTURES)}); "
                          f"use the family that reads it")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise ConfigError(f"HF config head_dim={head_dim} != hidden_size/num_attention_heads: trainlib's Llama "
                          "derives head_dim from dim and n_heads; this checkpoint cannot be imported")
    return ModelArgs(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"], norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling_factor=float(rope["factor"]) if llama3 else None,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_seq_len=int(rope.get("original_max_position_embeddings", 8192)),
        max_seq_len=int(cfg.get("max_position_embeddings", 131072)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict:
    rope_scaling = None
    if args.rope_scaling_factor is not None:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                        "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_seq_len}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype, "bos_token_id": None, "eos_token_id": None,
    }


# --------------------------------------------------------------------------- weights


def hf_weight_names(hf_names, args: ModelArgs) -> dict[str, str]:
    """trainlib name -> HF name of every model weight among `hf_names`
    (anything else, e.g. rotary inv_freq buffers of old exports, is left
    out); a tied model's one matrix serves as `output.weight` too."""
    names = {}
    for name in hf_names:
        ours = from_hf_name(name)
        if ours is not None:
            names[ours] = name
    if "output.weight" not in names and "tok_embeddings.weight" in names:  # tied embeddings store one matrix
        names["output.weight"] = names["tok_embeddings.weight"]
    return names


def _rotary_heads(name: str, args: ModelArgs) -> int | None:
    """The heads whose rows the rotary layouts order differently, for wq and wk; None for other weights."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def hf_row_order(ours: str, args: ModelArgs) -> torch.Tensor | None:
    """For wq and wk, the HF row each trainlib row is (trainlib's row i is
    HF's row `order[i]`), so a caller can gather only the rows it needs;
    None for weights HF stores in trainlib's order."""
    heads = _rotary_heads(ours, args)
    if heads is None:
        return None
    return _hf_to_meta(torch.arange(heads * args.head_dim).unsqueeze(1), heads).squeeze(1)


def hf_weight_to_trainlib(ours: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The HF tensor of trainlib weight `ours` in trainlib's layout: wq and
    wk rows permuted to adjacent rotary pairs, the rest as it is."""
    order = hf_row_order(ours, args)
    return t if order is None else t.index_select(0, order.to(t.device))


def trainlib_weight_names(names, args: ModelArgs) -> dict[str, str]:
    """HF name of every trainlib weight among `names` that an HF folder
    stores: a tied model stores one matrix, the embedding."""
    return {name: to_hf_name(name) for name in names if not (name == "output.weight" and args.tie_embeddings)}


def trainlib_weight_to_hf(name: str, t: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Trainlib weight `name` in HF's layout: wq and wk rows permuted to
    rotate-half order, the rest as it is."""
    heads = _rotary_heads(name, args)
    return t if heads is None else _meta_to_hf(t, heads)


# --------------------------------------------------------------------------- Meta's reference format


def read_meta_checkpoint(file: Path, expected: ModelArgs) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(the shape it holds, its weights) of a single-file Meta reference
    checkpoint (`consolidated.00.pth` [+ params.json beside it]). Its names and
    rotary layout are trainlib's own: no renaming, no permutation. The head
    counts come from params.json where there is one (the weights alone cannot
    tell them), else from `expected`, as do the rotary settings."""
    sd = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if "output.weight" not in sd and "tok_embeddings.weight" in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    heads, kv = expected.n_heads, expected.n_kv_heads
    params = Path(file).parent / "params.json"
    if params.is_file():
        p = json.loads(params.read_text())
        heads = p.get("n_heads", heads)
        kv = p.get("n_kv_heads", heads)
    w1 = sd["layers.0.feed_forward.w1.weight"]
    n_layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    args = replace(expected, dim=w1.shape[1], n_layers=n_layers, n_heads=heads, n_kv_heads=kv, ffn_dim=w1.shape[0],
                   vocab_size=sd["tok_embeddings.weight"].shape[0])
    return args, sd
