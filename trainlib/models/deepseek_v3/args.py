"""DeepSeek-V3's shapes: `ModelArgs`, the published `FLAVORS`, `get_model_args`. Torch-free: the command
line and recipes are checked against them before torch is imported (trainlib.models.flavors)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace

from trainlib.blocks.config import MoEArgs
from trainlib.errors import ConfigError

NAME = "deepseek_v3"  # model.name


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int  # the dense first blocks' MLP width (Hugging Face's intermediate_size)
    moe: MoEArgs
    n_dense_layers: int = 1  # blocks 0 .. n_dense_layers - 1 have a dense MLP, the rest an MoE
    # Multi-head latent attention (MLA)
    q_lora_rank: int = 0  # 0: queries by one projection `wq`; > 0: wq_a -> q_norm -> wq_b through this rank
    kv_lora_rank: int = 512  # the compressed key/value latent `wkv_a` makes (before kv_norm and wkv_b)
    qk_nope_head_dim: int = 128  # each head's query/key features without RoPE
    qk_rope_head_dim: int = 64  # each head's query/key features with RoPE (the key's are shared by every head)
    v_head_dim: int = 128
    # RoPE with YaRN scaling, applied when rope_factor > 1 (as transformers does whenever config.json names yarn)
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    original_seq_len: int = 4096  # YaRN's original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0  # 0: the softmax scale is not changed by YaRN
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3: 1)

    def __post_init__(self) -> None:
        # A checkpoint records the args as a dict of their fields (dataclasses.asdict), `moe` as a dict.
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEArgs(**self.moe))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """(nope + rope) ** -0.5, times YaRN's mscale^2 (from mscale_all_dim) when YaRN applies."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_factor > 1 and self.mscale_all_dim:
            m = yarn_mscale(self.rope_factor, self.mscale_all_dim)
            scale *= m * m
        return scale

    def validate(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "max_seq_len", "original_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.q_lora_rank < 0:
            raise ConfigError(f"model.q_lora_rank must be >= 0 (0: no query compression), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for rotary "
                              f"embeddings, which rotate pairs of features: set an even value")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(f"model.n_dense_layers ({self.n_dense_layers}) must be between 0 and model.n_layers "
                              f"({self.n_layers}): the first n_dense_layers blocks are dense, the rest MoE")
        if self.mtp_depth < 0:
            raise ConfigError(f"model.mtp_depth must be >= 0 (0: no multi-token prediction), got {self.mtp_depth}")
        if self.mtp_depth and self.n_dense_layers == self.n_layers:
            raise ConfigError(f"model.mtp_depth ({self.mtp_depth}) needs an MoE block to copy (each MTP module "
                              f"holds one block of the last layer's kind), but all {self.n_layers} blocks are "
                              f"dense; lower n_dense_layers or set mtp_depth = 0")
        for key in ("norm_eps", "rope_theta", "rope_factor", "beta_fast", "beta_slow"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"model.{key} must be > 0, got {getattr(self, key)}")
        self.moe.validate()


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature factor: 0.1 * mscale * ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# Published shapes.
# - deepseek_v3_671b: deepseek-ai/DeepSeek-V3's config.json (hidden_size 7168, 61 layers, 128 heads,
#   q_lora_rank 1536, kv_lora_rank 512, qk 128 + 64, v 128, intermediate_size 18432, 256 routed experts of
#   2048 in 8 groups keeping 4, 8 per token, routed_scaling_factor 2.5, 1 shared expert, first_k_dense_replace
#   3, vocab 129280, rope_theta 10000 with yarn factor 40 over 4096, beta_fast 32, beta_slow 1, mscale and
#   mscale_all_dim 1.0, max_position_embeddings 163840, num_nextn_predict_layers 1).
# - kimi_k2: moonshotai/Kimi-K2-Base/-Instruct's config.json (the DeepSeek-V3 decoder at 1T: 384 experts in
#   one group, 64 heads, first_k_dense_replace 1, 1 shared expert, routed_scaling_factor 2.827, vocab 163840,
#   rope_theta 50000 with yarn factor 32 over 4096, beta_fast and beta_slow 1, mscale and mscale_all_dim 1.0,
#   max_position_embeddings 131072, no MTP module).
# - deepseek_v3_16b: TorchTitan's deepseek_v3 "16B" flavor, the shape of deepseek-ai/DeepSeek-V2-Lite
#   (hidden 2048, 27 layers, 16 heads, q_lora_rank 0, 64 experts of 1408, 6 per token, 2 shared, 1 dense block
#   of 10944, vocab 102400, softmax routing without renormalisation, yarn factor 40 with mscale and
#   mscale_all_dim 0.707).
# `debug_deepseek` is ours: the 671B shape shrunk so it trains in seconds on one CPU process, keeping every path
# the big one takes (q-LoRA, YaRN, sigmoid top2-sum group routing with 8 experts in 4 groups keeping 2, a dense
# first block, a shared expert, one MTP module). `debug` is the same shape, under the name every family's
# smallest flavor has (tests/unit/test_model_contract.py).
_DEBUG = dict(dim=64, n_layers=4, n_heads=4, vocab_size=512, ffn_dim=192, n_dense_layers=1,
              q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              rope_factor=4.0, original_seq_len=256, mscale=1.0, mscale_all_dim=1.0, max_seq_len=4096, mtp_depth=1,
              moe=MoEArgs(n_experts=8, top_k=2, expert_dim=32, n_shared_experts=1, score_func="sigmoid",
                          route_scale=2.5, n_groups=4, topk_groups=2, group_score="top2_sum"))

FLAVORS: dict[str, ModelArgs] = {
    "debug_deepseek": ModelArgs(**_DEBUG),
    "debug": ModelArgs(**_DEBUG),
    "deepseek_v3_16b": ModelArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_dim=10944, n_dense_layers=1,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, mscale=0.707, mscale_all_dim=0.707, max_seq_len=163840,
        moe=MoEArgs(n_experts=64, top_k=6, expert_dim=1408, n_shared_experts=2, score_func="softmax",
                    route_norm=False),
    ),
    "deepseek_v3_671b": ModelArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_dim=18432, n_dense_layers=3,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_factor=40.0, mscale=1.0, mscale_all_dim=1.0, max_seq_len=163840, mtp_depth=1,
        moe=MoEArgs(n_experts=256, top_k=8, expert_dim=2048, n_shared_experts=1, score_func="sigmoid",
                    route_scale=2.5, n_groups=8, topk_groups=4, group_score="top2_sum"),
    ),
    "kimi_k2": ModelArgs(
        dim=7168, n_layers=61, n_heads=64, vocab_size=163840, ffn_dim=18432, n_dense_layers=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_theta=50000.0, rope_factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        max_seq_len=131072,
        moe=MoEArgs(n_experts=384, top_k=8, expert_dim=2048, n_shared_experts=1, score_func="sigmoid",
                    route_scale=2.827, group_score="top2_sum"),
    ),
}


def get_model_args(flavor: str, **overrides) -> ModelArgs:
    if flavor not in FLAVORS:
        close = difflib.get_close_matches(flavor, FLAVORS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.flavor '{flavor}' for model.name '{NAME}'{hint} "
                          f"(valid: {', '.join(FLAVORS)})")
    args = replace(FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args
