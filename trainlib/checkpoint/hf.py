"""Hugging Face Llama <-> trainlib weights, without a process group.

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
import os
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainlib.models.llama3.model import ModelArgs
from trainlib.params import canonical_name, copy_full_

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
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise ValueError(f"HF config head_dim={head_dim} != hidden_size/num_attention_heads: trainlib's Llama "
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


def args_from_dict(d: dict) -> ModelArgs:
    names = {f.name for f in fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------- weights


def checkpoint_format(path: str | os.PathLike) -> Literal["hf", "meta", "dcp"]:
    """What `checkpoint.initial_load_path` points at: a Hugging Face folder
    (config.json + *.safetensors), a Meta reference folder (consolidated.*.pth)
    or a DCP checkpoint folder (.metadata)."""
    if is_hf_folder(path):
        return "hf"
    if is_meta_folder(path):
        return "meta"
    if (Path(path) / ".metadata").is_file():
        return "dcp"
    raise ValueError(f"checkpoint.initial_load_path={str(path)!r} is neither a DCP checkpoint folder (.metadata), "
                     "a Hugging Face folder (config.json + *.safetensors) nor a Meta folder (consolidated.00.pth)")


def is_hf_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_hf_folder(path: str | os.PathLike) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(model shape, trainlib-named full tensors) from an HF folder, sharded
    (`model.safetensors.index.json`) or not."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_hf_folder(path):
        raise ValueError(f"{path} is not a Hugging Face checkpoint folder: expected config.json and *.safetensors")
    args = args_from_hf_config(json.loads((path / "config.json").read_text()))
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    return args, hf_to_trainlib(hf, args)


def hf_to_trainlib(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    sd = {}
    for name, t in hf.items():
        ours = from_hf_name(name)
        if ours is None:
            continue
        if ours.endswith("attention.wq.weight"):
            t = _hf_to_meta(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = _hf_to_meta(t, args.n_kv_heads)
        sd[ours] = t
    if "output.weight" not in sd and "tok_embeddings.weight" in sd:  # tied embeddings store one matrix
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd


def trainlib_to_hf(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf = {}
    for name, t in sd.items():
        if name == "output.weight" and args.tie_embeddings:
            continue
        if name.endswith("attention.wq.weight"):
            t = _meta_to_hf(t, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = _meta_to_hf(t, args.n_kv_heads)
        hf[to_hf_name(name)] = t.contiguous()
    return hf


def write_hf_folder(sd: dict[str, torch.Tensor], args: ModelArgs, out_dir: str | os.PathLike) -> Path:
    """One consolidated `model.safetensors` + `config.json`."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = trainlib_to_hf(sd, args)
    dtype = str(next(iter(hf.values())).dtype).replace("torch.", "")
    save_file(hf, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_from_args(args, dtype), indent=2) + "\n")
    return out


def check_shapes(sd: dict[str, torch.Tensor], args: ModelArgs, expected: ModelArgs, source: str) -> None:
    if (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) != (
            expected.dim, expected.n_layers, expected.n_heads, expected.n_kv_heads, expected.ffn_dim,
            expected.vocab_size):
        raise ValueError(
            f"{source} holds a model of dim={args.dim} n_layers={args.n_layers} n_heads={args.n_heads} "
            f"n_kv_heads={args.n_kv_heads} ffn_dim={args.ffn_dim} vocab_size={args.vocab_size}, but this run builds "
            f"dim={expected.dim} n_layers={expected.n_layers} n_heads={expected.n_heads} "
            f"n_kv_heads={expected.n_kv_heads} ffn_dim={expected.ffn_dim} vocab_size={expected.vocab_size}; "
            "set model.flavor / model.n_layers / model.vocab_size to match")


def load_full_state_into_model(model_parts: list[nn.Module], sd: dict[str, torch.Tensor]) -> None:
    """Copy full (unsharded) tensors, keyed by canonical name, into possibly
    sharded parameters: each rank keeps its own shard, no communication."""
    for part in model_parts:
        for name, p in part.named_parameters():
            copy_full_(p, sd[canonical_name(name)])


def load_hf_into_model(model_parts: list[nn.Module], path: str | os.PathLike, expected: Any = None) -> None:
    args, sd = read_hf_folder(path)
    if expected is not None:
        check_shapes(sd, args, expected, f"HF checkpoint {path}")
    load_full_state_into_model(model_parts, sd)


# --------------------------------------------------------------------------- Meta format


def is_meta_folder(path: str | os.PathLike) -> bool:
    return any(Path(path).glob("consolidated.*.pth"))


def load_meta_into_model(model_parts: list[nn.Module], path: str | os.PathLike, expected: Any = None) -> None:
    """Weights from Meta's reference format (`consolidated.00.pth` [+ params.json]).
    Its names and rotary layout are trainlib's own, so no renaming or permutation.
    The rotary settings come from the run's model.flavor, not from the file."""
    files = sorted(Path(path).glob("consolidated.*.pth"))
    if len(files) != 1:
        raise ValueError(f"{path} holds {len(files)} consolidated.*.pth files (model-parallel shards); only "
                         "single-file Meta checkpoints load directly: convert larger ones to HF format first")
    sd = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    sd = {k: v for k, v in sd.items() if not k.startswith("rope.")}
    if "output.weight" not in sd and "tok_embeddings.weight" in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    if expected is not None:
        w1 = sd["layers.0.feed_forward.w1.weight"]
        heads = expected.n_heads  # params.json is optional; heads cannot be read from weights alone
        params = Path(path) / "params.json"
        if params.is_file():
            p = json.loads(params.read_text())
            heads = p.get("n_heads", heads)
            kv = p.get("n_kv_heads", heads)
        else:
            kv = expected.n_kv_heads
        n_layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
        args = ModelArgs(dim=w1.shape[1], n_layers=n_layers, n_heads=heads, n_kv_heads=kv, ffn_dim=w1.shape[0],
                         vocab_size=sd["tok_embeddings.weight"].shape[0])
        check_shapes(sd, args, expected, f"Meta checkpoint {path}")
    load_full_state_into_model(model_parts, sd)

