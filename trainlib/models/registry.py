"""Model registry: the recipe key `model.name` selects a family here.

One line per family: each family package builds its own `ModelSpec` (the
model contract, `trainlib/models/spec.py`); `trainlib.build.build_model_parts`
(used by train, the planner and custom loops) and the rest of the runtime read
everything else from that entry.
"""

from __future__ import annotations

import difflib
from typing import Any

from trainlib.errors import ConfigError
from trainlib.models import llama3, qwen3, qwen3_moe
from trainlib.models.spec import ModelSpec

# The family of a recipe that names none (model.name's default).
DEFAULT_MODEL = llama3.SPEC.name

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    llama3.SPEC,
    qwen3.SPEC,
    qwen3_moe.SPEC,
)}


def get_model_spec(name: str) -> ModelSpec:
    """The family registered as `name`; an unknown name is one line naming the closest one."""
    if name not in MODELS:
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.name '{name}'{hint} (valid: {', '.join(MODELS)})")
    return MODELS[name]


def model_args(model_cfg) -> Any:
    """The model shape a [model] recipe section (ModelConfig) asks for: its
    family's flavor with the n_layers / vocab_size overrides applied."""
    spec = get_model_spec(model_cfg.name)
    if model_cfg.flavor not in spec.flavors:
        owners = [other.name for other in MODELS.values() if model_cfg.flavor in other.flavors]
        if owners:
            raise ConfigError(f"model.flavor '{model_cfg.flavor}' is a flavor of {' and '.join(owners)}, but "
                              f"model.name is '{spec.name}'; set model.name = '{owners[0]}', or pick one of "
                              f"{spec.name}'s flavors: {', '.join(spec.flavors)}")
    return spec.get_args(model_cfg.flavor, n_layers=model_cfg.n_layers, vocab_size=model_cfg.vocab_size)
