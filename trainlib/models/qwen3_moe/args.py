"""Qwen3-MoE's shapes: `ModelArgs`, the published `FLAVORS`, `get_model_args`. Torch-free: the command
line and recipes are checked against them before torch is imported (trainlib.models.flavors)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from trainlib.errors import ConfigError
from trainlib.blocks.config import MoEArgs
from trainlib.models.qwen3.args import ModelArgs as Qwen3Args

NAME = "qwen3_moe"  # model.name


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # the dense first blocks' MLP width (Hugging Face's intermediate_size)
    vocab_size: int
    moe: MoEArgs
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    n_dense_layers: int = 0  # blocks 0 .. n_dense_layers - 1 have a dense MLP, the rest an MoE

    def __post_init__(self) -> None:
        # A checkpoint records the args as a dict of their fields (dataclasses.asdict), `moe` as a dict.
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEArgs(**self.moe))

    def validate(self) -> None:
        Qwen3Args.validate(self)  # the same attention, RoPE and norm rules
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"model.n_dense_layers ({self.n_dense_layers}) must be between 0 and model.n_layers "
                              f"({self.n_layers}): the first n_dense_layers blocks are dense, the rest MoE")
        self.moe.validate()


# Published shapes, from the config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on the Hugging
# Face hub: hidden_size (dim), num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
# intermediate_size (ffn_dim, the width a dense block would have; no published block is dense:
# mlp_only_layers [] and decoder_sparse_step 1), num_experts, num_experts_per_tok (top_k),
# moe_intermediate_size (expert_dim), vocab_size 151936, norm_topk_prob true (route_norm), rope_theta 1e6,
# max_position_embeddings 40960, rms_norm_eps 1e-6, untied embeddings. The model cards give 30.5B total /
# 3.3B activated and 235B total / 22B activated parameters (tests/unit/test_qwen3_moe.py checks them).
# `debug_moe` is ours: it trains in seconds on CPU and keeps what the code paths need to see: GQA,
# head_dim != dim / n_heads, a dense first block before the MoE ones, top-2 of 8 experts. `debug` is the
# same shape, under the name every family's smallest flavor has (tests/unit/test_model_contract.py).
_DEBUG = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192, vocab_size=512,
              max_seq_len=4096, moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32), n_dense_layers=1)


FLAVORS: dict[str, ModelArgs] = {
    "debug_moe": ModelArgs(**_DEBUG),
    "debug": ModelArgs(**_DEBUG),
    "qwen3_30b_a3b": ModelArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144, vocab_size=151936,
        moe=MoEArgs(n_experts=128, top_k=8, expert_dim=768),
    ),
    "qwen3_235b_a22b": ModelArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_dim=12288, vocab_size=151936,
        moe=MoEArgs(n_experts=128, top_k=8, expert_dim=1536),
    ),
}


def get_model_args(flavor: str, **overrides) -> ModelArgs:
    if flavor not in FLAVORS:
        close = difflib.get_close_matches(flavor, FLAVORS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.flavor '{flavor}' for model.name 'qwen3_moe'{hint} "
                          f"(valid: {', '.join(FLAVORS)})")
    args = replace(FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args

