"""Llama 3's shapes: `ModelArgs`, the published `FLAVORS`, `get_model_args`. Torch-free: the command
line and recipes are checked against them before torch is imported (trainlib.models.flavors)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace

from trainlib.errors import ConfigError

NAME = "llama3"  # model.name


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 frequency scaling (None disables it). Published values:
    # 8B/70B/405B factor 8, Llama 3.2 1B/3B factor 32.
    rope_scaling_factor: float | None = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 131072
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> None:
        for key in ("n_layers", "vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) for GQA"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")


# Published shapes. `debug` is ours: small enough that 4 CPU processes train it
# in seconds, while keeping GQA (4 heads, 2 kv heads) so TP/GQA code paths run.
FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=512,
        rope_theta=10000.0, rope_scaling_factor=None, max_seq_len=4096,
    ),
    "llama3.2_1b": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        rope_scaling_factor=32.0, tie_embeddings=True,
    ),
    "llama3.2_3b": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
        rope_scaling_factor=32.0, tie_embeddings=True,
    ),
    "llama3.1_8b": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256
    ),
    "llama3.1_70b": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256
    ),
    "llama3.1_405b": ModelArgs(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256
    ),
}


def get_model_args(flavor: str, **overrides) -> ModelArgs:
    if flavor not in FLAVORS:


        close = difflib.get_close_matches(flavor, FLAVORS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.flavor '{flavor}'{hint} (valid: {', '.join(FLAVORS)})")
    args = replace(FLAVORS[flavor], **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args

