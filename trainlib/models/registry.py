"""Model registry: the recipe key `model.name` selects a family here.

An entry holds what the job needs from a model family and nothing else:
  flavors             published shapes, by `model.flavor`
  get_args            (flavor, **shape overrides) -> validated args; one-line ConfigError naming the closest flavor
  model_cls           the plain single-device module, built as `model_cls(args, rope_len=seq_len)` on meta
  parallelize         applies the parallel axes in the family's fixed order (see llama3/parallelize.py)
  flops_per_token     training FLOPs per token, for MFU and the planner
  block_forward_flops one block's forward FLOPs per token, op by op: what the planner counts as recomputed
  state_dict_adapter  module mapping names/layouts to and from Hugging Face checkpoints

Adding a family is a package under trainlib/models/ and one entry in MODELS;
`trainlib.build.build_model_parts` (used by train, the planner and custom loops)
reads everything else from the entry.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import nn

from trainlib.errors import ConfigError
from trainlib.models import llama3


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: Mapping[str, Any]
    get_args: Callable[..., Any]
    model_cls: type[nn.Module]
    parallelize: Callable[..., nn.Module]
    flops_per_token: Callable[[Any, int], float]
    block_forward_flops: Callable[[Any, int], list[tuple[str, float, bool]]]
    state_dict_adapter: ModuleType


MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        flavors=llama3.FLAVORS,
        get_args=llama3.get_model_args,
        model_cls=llama3.Transformer,
        parallelize=llama3.parallelize_llama,
        flops_per_token=llama3.flops_per_token,
        block_forward_flops=llama3.block_forward_flops,
        state_dict_adapter=llama3.state_dict_adapter,
    ),
}


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODELS:
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.name '{name}'{hint} (valid: {', '.join(MODELS)})")
    return MODELS[name]


def model_args(model_cfg) -> Any:
    """The model shape a [model] recipe section (ModelConfig) asks for: its
    family's flavor with the n_layers / vocab_size overrides applied."""
    spec = get_model_spec(model_cfg.name)
    return spec.get_args(model_cfg.flavor, n_layers=model_cfg.n_layers, vocab_size=model_cfg.vocab_size)
