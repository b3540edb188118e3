"""Qwen3's shapes: `ModelArgs`, the published `FLAVORS`, `get_model_args`. Torch-free: the command
line and recipes are checked against them before torch is imported (trainlib.models.flavors)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from trainlib.errors import ConfigError

NAME = "qwen3"  # model.name


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False

    def validate(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.n_heads % self.n_kv_heads:
            divisors = ", ".join(str(d) for d in range(1, self.n_heads + 1) if self.n_heads % d == 0)
            raise ConfigError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads "
                              f"({self.n_kv_heads}) for grouped-query attention: set n_kv_heads to one of "
                              f"{divisors}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim ({self.head_dim}) must be even for rotary embeddings, which "
                              f"rotate pairs of features: set an even head_dim (e.g. {self.head_dim + 1})")
        if not self.norm_eps > 0:
            raise ConfigError(f"model.norm_eps must be > 0, got {self.norm_eps} (Qwen3 uses 1e-6)")
        if not self.rope_theta > 0:
            raise ConfigError(f"model.rope_theta must be > 0, got {self.rope_theta} (Qwen3 uses 1e6)")


# Published shapes, from the config.json of each Qwen/Qwen3-* repository on the
# Hugging Face hub (max_seq_len is the post-trained models' 40960; the -Base
# models state 32768). `debug` and `debug_tied` are ours: they train in seconds
# on CPU and keep what the code paths need to see: GQA, head_dim != dim /
# n_heads, and (debug_tied) tied embeddings; `debug` runs every parallel layout.
FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192, vocab_size=512,
        max_seq_len=4096,
    ),
    # the small flavors' tied embeddings (tensor parallel shards the one matrix; pipeline parallel refuses it)
    "debug_tied": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=192, vocab_size=512,
        max_seq_len=4096, tie_embeddings=True,
    ),
    "qwen3_0.6b": ModelArgs(
        dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072, vocab_size=151936,
        tie_embeddings=True,
    ),
    "qwen3_1.7b": ModelArgs(
        dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144, vocab_size=151936,
        tie_embeddings=True,
    ),
    "qwen3_4b": ModelArgs(
        dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728, vocab_size=151936,
        tie_embeddings=True,
    ),
    "qwen3_8b": ModelArgs(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, vocab_size=151936,
    ),
    "qwen3_14b": ModelArgs(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, head_dim=128, ffn_dim=17408, vocab_size=151936,
    ),
    "qwen3_32b": ModelArgs(
        dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600, vocab_size=151936,
    ),
}


def get_model_args(flavor: str, **overrides) -> ModelArgs:
    if flavor not in FLAVORS:
        close = difflib.get_close_matches(flavor, FLAVORS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.flavor '{flavor}' for model.name 'qwen3'{hint} "
                          f"(valid: {', '.join(FLAVORS)})")
    args = replace(FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args

