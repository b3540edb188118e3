"""Typed, strict TOML recipes: `load_job_config` and the section dataclasses."""

from trainlib.config.job import JobConfig, JobSection, ModelConfig, TrainingConfig
from trainlib.config.loader import ConfigError, config_to_dict, load_recipe, save_config
from trainlib.config.recipes import resolve_recipe


def load_job_config(recipe: str | None, overrides=()) -> JobConfig:
    """`recipe`: a shipped recipe's name (`llama70b`, `debug.toml`), a path, or None for the defaults."""
    return load_recipe(JobConfig, None if recipe is None else resolve_recipe(recipe), overrides)


__all__ = [
    "ConfigError", "JobConfig", "JobSection", "ModelConfig", "TrainingConfig",
    "config_to_dict", "load_job_config", "load_recipe", "resolve_recipe", "save_config",
]
