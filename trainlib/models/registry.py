"""Model registry: the recipe key `model.name` selects a family here.

One line per family: each family package builds its own `ModelSpec` (the
model contract, `trainlib/models/spec.py`); `trainlib.build.build_model_parts`
(used by train, the planner and custom loops) and the rest of the runtime read
everything else from that entry. The families' names and shapes alone, which
need no torch, are in `flavors.py` (a family is added to both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainlib.models import deepseek_v3, llama3, qwen3, qwen3_moe
from trainlib.models.flavors import DEFAULT_MODEL, check_name, model_args
from trainlib.models.spec import ModelSpec

__all__ = ["DEFAULT_MODEL", "MODELS", "ResolvedModel", "get_model_spec", "model_args", "resolve_model"]

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    llama3.SPEC,
    qwen3.SPEC,
    qwen3_moe.SPEC,
    deepseek_v3.SPEC,
)}


def get_model_spec(name: str) -> ModelSpec:
    """The family registered as `name`; an unknown name is one line naming the closest one."""
    check_name(name)
    return MODELS[name]


@dataclass(frozen=True)
class ResolvedModel:
    """A [model] section resolved once: the family's spec and the args of its flavor with the overrides.
    The job resolves it at start-up and passes it along (validation, build, metrics), so nothing below the
    command line looks a family up by name again."""

    spec: ModelSpec
    args: Any


def resolve_model(model_cfg, shape: Any = None) -> ResolvedModel:
    """The family and shape a [model] section (ModelConfig) names; bad names are one-line ConfigErrors.
    `shape`: the checkpoint's args that model.flavor = 'from_checkpoint' takes (`trainlib.config.model_shape`)."""
    return ResolvedModel(get_model_spec(model_cfg.name), model_args(model_cfg, shape))
