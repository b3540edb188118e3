"""Typed, strict TOML recipes: `load_job_config` and the section dataclasses."""

from trainlib.config.job import JobConfig, JobSection, ModelConfig, TrainingConfig
from trainlib.config.loader import ConfigError, config_to_dict, load_recipe, save_config


def load_job_config(recipe: str | None, overrides=()) -> JobConfig:
    return load_recipe(JobConfig, recipe, overrides)


__all__ = [
    "ConfigError", "JobConfig", "JobSection", "ModelConfig", "TrainingConfig",
    "config_to_dict", "load_job_config", "load_recipe", "save_config",
]
