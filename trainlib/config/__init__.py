"""Typed, strict TOML recipes: `load_job_config` and the section dataclasses."""

from trainlib.config.job import JobConfig, JobSection, ModelConfig, TrainingConfig
from trainlib.config.loader import ConfigError, config_to_dict, load_recipe, save_config
from trainlib.config.recipes import resolve_recipe


def load_job_config(recipe: str | None, overrides=()) -> JobConfig:
    """`recipe`: a shipped recipe's name (`llama70b`, `debug.toml`), a path, or None for the defaults."""
    return load_recipe(JobConfig, None if recipe is None else resolve_recipe(recipe), overrides)


def model_shape(cfg: JobConfig):
    """The args `model.flavor = 'from_checkpoint'` takes: those checkpoint.initial_load_path records (an HF
    folder's config.json, a DCP checkpoint's model args); None for a named flavor. Imports torch."""
    from trainlib.models.flavors import FROM_CHECKPOINT

    if cfg.model.flavor != FROM_CHECKPOINT:
        return None
    from trainlib.checkpoint.convert import recorded_model_args

    return recorded_model_args(cfg.checkpoint.initial_load_path)


def job_model_args(cfg: JobConfig):
    """The job's model shape: its flavor with the overrides, or the checkpoint's (`model_shape`)."""
    from trainlib.models.flavors import model_args

    return model_args(cfg.model, model_shape(cfg))


def resolve_job_model(cfg: JobConfig):
    """`trainlib.models.registry.resolve_model` of the job's [model], the checkpoint's shape included."""
    from trainlib.models.registry import resolve_model

    return resolve_model(cfg.model, model_shape(cfg))


__all__ = [
    "ConfigError", "JobConfig", "JobSection", "ModelConfig", "TrainingConfig",
    "config_to_dict", "job_model_args", "load_job_config", "model_shape", "resolve_job_model", "load_recipe", "resolve_recipe", "save_config",
]
