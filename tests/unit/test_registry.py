"""The model registry: model.name selects the family whose spec the job, the planner and the checkpoints
use. The second family is a real one (Qwen3 dense: its own modules, TP plan, shape rules and HF adapter),
so these fail if the runtime reads anything of a family outside its spec."""

import pytest

from trainlib.config import ConfigError, load_job_config
from trainlib.models import registry
from trainlib.models.registry import model_args, resolve_model
from trainlib.plan import make_plan
from trainlib.train import train


def test_the_second_family_trains_checkpoints_and_plans_by_its_spec(tmp_path):
    cfg = load_job_config(None, [f"--job.dump_folder={tmp_path}", "--model.name=qwen3", "--training.steps=2",
                                 "--training.seq_len=32", "--training.global_batch_size=2", "--metrics.console=false",
                                 "--checkpoint.enable=true", "--checkpoint.interval=2"])
    records = train(cfg)
    assert len(records) == 2 and records[-1]["loss"] < records[0]["loss"] + 1
    from trainlib.checkpoint.convert import saved_model_args

    saved = saved_model_args(tmp_path / "checkpoint" / "step-2")  # the checkpoint records the family
    assert type(saved) is registry.MODELS["qwen3"].args_type and saved.head_dim == 32
    plan = make_plan(None, 4, overrides=["model.name=qwen3", "parallelism.tp=2", "parallelism.dp_shard=2"])
    with __import__("torch").device("meta"):
        model = registry.MODELS["qwen3"].model_cls(model_args(cfg.model), rope_len=8)
    assert plan.n_params == sum(p.numel() for p in model.parameters())


def test_name_and_flavor_are_checked_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"^unknown model.name 'qwen4'; did you mean 'qwen3'\? \(valid: llama3, "
                                          r"qwen3, qwen3_moe, deepseek_v3\)$"):
        load_job_config(None, ["--model.name=qwen4"])
    with pytest.raises(ConfigError, match=r"^model.flavor 'llama3.1_8b' is a flavor of llama3, but model.name is "
                                          r"'qwen3'; set model.name = 'llama3', or pick one of qwen3's flavors: "):
        load_job_config(None, ["--model.name=qwen3", "--model.flavor=llama3.1_8b"])
    with pytest.raises(ConfigError, match=r"did you mean 'llama3.1_8b'\?") as e:
        load_job_config(None, ["--model.flavor=llama3.1_8"])
    assert "\n" not in str(e.value)


def test_a_shape_the_parallel_degrees_cannot_split_is_one_line_naming_the_family_rule():
    from trainlib.config.validate import validate_job
    from trainlib.parallel import ParallelDims

    cfg = load_job_config(None, ["--model.name=qwen3", "--model.flavor=qwen3_14b", "--parallelism.tp=16",
                                 "--parallelism.dp_shard=1"])
    with pytest.raises(ConfigError, match=r"^model n_heads \(40\) must be divisible by parallelism.tp \(16\): each TP "
                                          r"rank owns 1/tp of them; choose tp dividing 40$"):
        validate_job(cfg, ParallelDims(world_size=16, dp_shard=1, tp=16), resolve_model(cfg.model), 256)
    cfg = load_job_config(None, ["--model.name=qwen3", "--model.flavor=qwen3_1.7b", "--parallelism.pp=2",
                                 "--parallelism.dp_shard=1"])
    with pytest.raises(ConfigError, match=r"^this Qwen3 flavor ties the embedding and output weights, .*\(pp=2\); "
                                          r"use pp=1 with it"):
        validate_job(cfg, ParallelDims(world_size=2, dp_shard=1, pp=2), resolve_model(cfg.model), 256)


def test_model_args_applies_the_shape_overrides():
    cfg = load_job_config(None, ["--model.flavor=llama3.1_8b", "--model.n_layers=2", "--model.vocab_size=1024"])
    args = model_args(cfg.model)
    assert (args.dim, args.n_layers, args.vocab_size) == (4096, 2, 1024)
    with pytest.raises(ConfigError, match="model.n_layers must be >= 1"):
        load_job_config(None, ["--model.n_layers=0"])


def test_the_torch_free_flavor_table_lists_the_registrys_families():
    """`model.name` and `model.flavor` are checked against trainlib.models.flavors (no torch); the job
    builds from the registry's specs: one family added to one and not the other fails here."""
    from trainlib.models.flavors import DEFAULT_MODEL, FAMILIES

    assert list(FAMILIES) == list(registry.MODELS) and DEFAULT_MODEL in FAMILIES
    for name, family in FAMILIES.items():
        spec = registry.MODELS[name]
        assert (spec.flavors, spec.get_args, spec.args_type) == (family.FLAVORS, family.get_model_args,
                                                                 family.ModelArgs)
