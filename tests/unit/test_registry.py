"""The model registry: model.name selects the family whose class, flavors and
parallelize function the job and the planner use; a second family needs no
edit to trainlib/train.py."""

from dataclasses import replace

import pytest

from trainlib.config import ConfigError, load_job_config
from trainlib.models import llama3, registry
from trainlib.models.registry import ModelSpec, model_args
from trainlib.plan import make_plan
from trainlib.train import train

BUILT, PARALLELIZED = [], []


class TinyLM(llama3.Transformer):  # stands for another family's module class
    def __init__(self, args, rope_len=None):
        super().__init__(args, rope_len)
        BUILT.append(args)


def _parallelize(model, *a, **kw):
    PARALLELIZED.append(type(model).__name__)
    return llama3.parallelize_llama(model, *a, **kw)


TINY = {"tiny2": replace(llama3.FLAVORS["debug"], n_layers=2, dim=32, ffn_dim=64)}


def _get_args(flavor, **overrides):
    if flavor not in TINY:
        raise ConfigError(f"unknown model.flavor '{flavor}' for tinylm (valid: {', '.join(TINY)})")
    return replace(TINY[flavor], **{k: v for k, v in overrides.items() if v is not None})


@pytest.fixture
def tinylm(monkeypatch):
    spec = ModelSpec(name="tinylm", flavors=TINY, get_args=_get_args, model_cls=TinyLM, parallelize=_parallelize,
                     flops_per_token=llama3.flops_per_token,
                     block_forward_flops=llama3.block_forward_flops, state_dict_adapter=llama3.state_dict_adapter)
    monkeypatch.setitem(registry.MODELS, "tinylm", spec)
    BUILT.clear()
    PARALLELIZED.clear()
    return spec


def test_a_registered_family_trains_and_plans_without_editing_train(tinylm, tmp_path):
    cfg = load_job_config(None, [f"--job.dump_folder={tmp_path}", "--model.name=tinylm", "--model.flavor=tiny2",
                                 "--training.steps=2", "--training.seq_len=32", "--training.global_batch_size=2",
                                 "--metrics.console=false"])
    records = train(cfg)
    assert len(records) == 2 and BUILT[0].dim == 32 and PARALLELIZED == ["TinyLM"]
    plan = make_plan(None, 1, overrides=["model.name=tinylm", "model.flavor=tiny2"])
    assert plan.n_params == sum(p.numel() for p in TinyLM(TINY["tiny2"], rope_len=8).parameters())


def test_name_and_flavor_are_checked_when_the_config_loads(tinylm):
    with pytest.raises(ConfigError, match=r"unknown model.name 'tinylmm'; did you mean 'tinylm'\?"):
        load_job_config(None, ["--model.name=tinylmm"])
    with pytest.raises(ConfigError, match="unknown model.flavor 'debug' for tinylm"):
        load_job_config(None, ["--model.name=tinylm"])  # the default flavor belongs to llama3
    with pytest.raises(ConfigError, match=r"did you mean 'llama3.1_8b'\?") as e:
        load_job_config(None, ["--model.flavor=llama3.1_8"])
    assert "\n" not in str(e.value)


def test_model_args_applies_the_shape_overrides():
    cfg = load_job_config(None, ["--model.flavor=llama3.1_8b", "--model.n_layers=2", "--model.vocab_size=1024"])
    args = model_args(cfg.model)
    assert (args.dim, args.n_layers, args.vocab_size) == (4096, 2, 1024)
    with pytest.raises(ConfigError, match="model.n_layers must be >= 1"):
        load_job_config(None, ["--model.n_layers=0"])
