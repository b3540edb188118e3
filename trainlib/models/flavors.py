"""The families' names and shapes, torch-free: what `[model]` is checked against when a recipe or
the command line is read, before torch is imported (the registry, `registry.py`, holds the families'
full `ModelSpec`s and imports torch).

One line per family here and one in registry.py; tests/unit/test_registry.py checks they agree.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import replace
from types import ModuleType
from typing import Any

from trainlib.errors import ConfigError
from trainlib.models.deepseek_v3 import args as deepseek_v3
from trainlib.models.llama3 import args as llama3
from trainlib.models.qwen3 import args as qwen3
from trainlib.models.qwen3_moe import args as qwen3_moe

# Each family's args module: NAME (its model.name), FLAVORS, ModelArgs, get_model_args.
FAMILIES: dict[str, ModuleType] = {family.NAME: family for family in (
    llama3,
    qwen3,
    qwen3_moe,
    deepseek_v3,
)}

# The family of a recipe that names none (model.name's default).
DEFAULT_MODEL = llama3.NAME

# model.flavor's value that takes the shape from checkpoint.initial_load_path (an HF folder's config.json or
# the args a DCP checkpoint records): any shape of a family trains, not only the shipped flavors.
FROM_CHECKPOINT = "from_checkpoint"


def _registered() -> dict:
    """Families added to the registry at run time (registry.MODELS[name] = spec, by a user's code or a
    test): whoever adds one has imported the registry, so its absence costs no torch import."""
    registry = sys.modules.get("trainlib.models.registry")
    return {k: v for k, v in registry.MODELS.items() if k not in FAMILIES} if registry is not None else {}


def check_name(name: str) -> None:
    """An unknown model.name is one line naming the closest one."""
    known = [*FAMILIES, *_registered()]
    if name not in known:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown model.name '{name}'{hint} (valid: {', '.join(known)})")


def model_args(model_cfg, shape: Any = None) -> Any:
    """The model shape a [model] recipe section (ModelConfig) asks for: its
    family's flavor with the n_layers / vocab_size overrides applied. With
    model.flavor = FROM_CHECKPOINT the flavor is `shape`, the args the job's
    checkpoint.initial_load_path records (`trainlib.config.model_shape`)."""
    check_name(model_cfg.name)
    overrides = {"n_layers": model_cfg.n_layers, "vocab_size": model_cfg.vocab_size}
    depth = getattr(model_cfg, "mtp_depth", None)
    if depth is not None:
        if not _has_mtp(model_cfg.name):
            if depth:
                with_mtp = [name for name in FAMILIES if _has_mtp(name)]
                raise ConfigError(f"model.mtp_depth = {depth}, but model.name '{model_cfg.name}' has no multi-token "
                                  f"prediction; set model.mtp_depth = 0, or use a family that has it: "
                                  f"{', '.join(with_mtp) or 'none'}")
        else:
            overrides["mtp_depth"] = depth
    if model_cfg.flavor == FROM_CHECKPOINT:
        return _from_checkpoint(model_cfg.name, shape, overrides)
    if model_cfg.name not in FAMILIES:
        return _registered()[model_cfg.name].get_args(model_cfg.flavor, **overrides)
    family = FAMILIES[model_cfg.name]
    if model_cfg.flavor not in family.FLAVORS:
        owners = [other.NAME for other in FAMILIES.values() if model_cfg.flavor in other.FLAVORS]
        if owners:
            raise ConfigError(f"model.flavor '{model_cfg.flavor}' is a flavor of {' and '.join(owners)}, but "
                              f"model.name is '{family.NAME}'; set model.name = '{owners[0]}', or pick one of "
                              f"{family.NAME}'s flavors: {', '.join(family.FLAVORS)}")
    return family.get_model_args(model_cfg.flavor, **overrides)


def _from_checkpoint(name: str, shape: Any, overrides: dict) -> Any:
    """`shape` (a checkpoint's args) as family `name`'s args, with the recipe's overrides."""
    if shape is None:
        raise ConfigError(f"model.flavor = '{FROM_CHECKPOINT}' takes the model's shape from "
                          "checkpoint.initial_load_path (a Hugging Face folder or a DCP checkpoint), and none was read: "
                          "set checkpoint.initial_load_path, or name a flavor")
    family = FAMILIES.get(name)
    args_type = family.ModelArgs if family is not None else _registered()[name].args_type
    if type(shape) is not args_type:
        owner = next((f.NAME for f in FAMILIES.values() if type(shape) is f.ModelArgs), type(shape).__name__)
        raise ConfigError(f"checkpoint.initial_load_path holds a {owner} model, but model.name is '{name}': set "
                          f"model.name = '{owner}' to train its shape (model.flavor = '{FROM_CHECKPOINT}')")
    args = replace(shape, **{k: v for k, v in overrides.items() if v is not None})
    args.validate()
    return args


def _has_mtp(name: str) -> bool:
    """Whether family `name`'s shape has multi-token prediction depth (an `mtp_depth` field)."""
    family = FAMILIES.get(name)
    args_type = family.ModelArgs if family is not None else _registered()[name].args_type
    return "mtp_depth" in getattr(args_type, "__dataclass_fields__", {})
