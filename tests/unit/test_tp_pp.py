"""Tensor and pipeline parallelism: stage split, config rules, init, and loss-curve parity."""

import typing

import pytest
import torch

from tests.helpers import RECIPES
from trainlib import compat
from trainlib.config import ConfigError, load_job_config
from trainlib.config.validate import validate_job, validate_machine
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.models.registry import ResolvedModel, get_model_spec
from trainlib.parallel import ParallelDims
from trainlib.parallel import pp as pp_lib
from trainlib.parallel.config import ParallelismConfig
from trainlib.parallel.fsdp import reshard_after_forward

DEBUG = str(RECIPES / "debug.toml")

# ---- stage split -----------------------------------------------------------------
def test_even_split_gives_the_remainder_to_middle_stages():
    assert pp_lib.layers_per_stage(4, 2) == [2, 2]
    assert pp_lib.layers_per_stage(10, 4) == [2, 3, 3, 2]
    assert pp_lib.layers_per_stage(126, 16) == [7] + [8] * 14 + [7]
    assert pp_lib.layers_per_stage(5, 4) == [1, 2, 1, 1]
    assert pp_lib.layers_per_stage(6, 3, [1, 3, 2]) == [1, 3, 2]



def _llama(args) -> ResolvedModel:
    return ResolvedModel(get_model_spec("llama3"), args)

def test_stage_placement_loop_and_v():
    assert [pp_lib.stage_ids(r, 2, 2, "Interleaved1F1B") for r in range(2)] == [[0, 2], [1, 3]]
    assert [pp_lib.stage_ids(r, 4, 2, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert pp_lib.stage_ids(1, 4, 1, "1F1B") == [1]


def test_split_stage_keeps_global_names():
    with torch.device("meta"):
        model = Transformer(get_model_args("debug"))
    roots = get_model_spec("llama3").stage_roots
    first = pp_lib.split_stage(model, 0, 2, is_first=True, is_last=False, roots=roots)
    last = pp_lib.split_stage(model, 2, 2, is_first=False, is_last=True, roots=roots)
    assert list(first.layers) == ["0", "1"] and first.norm is None and first.output is None
    assert list(last.layers) == ["2", "3"] and last.tok_embeddings is None
    names = {n for p in (first, last) for n, _ in p.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


# ---- config rules ------------------------------------------------------------------
def _validate(world, *overrides):
    cfg = load_job_config(DEBUG, list(overrides))
    par = cfg.parallelism
    dims = ParallelDims(world_size=world, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp,
                        tp=par.tp, pp=par.pp)
    validate_job(cfg, dims, _llama(get_model_args("debug")), 256)
    return cfg, dims


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="ZBVZeroBubble"):
        load_job_config(DEBUG, ["--parallelism.pp_schedule=ZeroBubbleV"])
    # The recipe key's choices are the library's schedules, and the library
    # function (for custom loops, which skip the recipe) refuses alike.
    choices = typing.get_args(typing.get_type_hints(ParallelismConfig)["pp_schedule"])
    assert set(choices) == set(pp_lib.SCHEDULES)
    with pytest.raises(ConfigError, match=r"unknown parallelism.pp_schedule 'ZeroBubbleV'; valid: GPipe, 1F1B"):
        pp_lib.schedule_class("ZeroBubbleV")


@pytest.mark.parametrize("overrides, match", [
    (["--parallelism.tp=4"], r"n_kv_heads \(2\) must be divisible by parallelism.tp \(4\).*GQA"),
    (["--parallelism.tp=2", "--training.seq_len=255"], "seq_len .255. must be divisible"),
    (["--parallelism.tp=2", "--parallelism.tp_async=true", "--job.device=cpu"], "tp_async.*not supported on CPU"),
    (["--parallelism.tp=2", "--parallelism.tp_async=true", "--job.device=cuda"],
     r"tp_async is done by torch.compile's micro-pipeline pass and needs compile.enable = true"),
    (["--parallelism.pp=2", "--parallelism.pp_schedule=1F1B", "--parallelism.pp_stages_per_rank=2"],
     "runs one stage per rank"),
    (["--parallelism.pp=2", "--parallelism.pp_schedule=DualPipeV", "--parallelism.pp_stages_per_rank=3"],
     "exactly 2 stages per rank"),
    (["--parallelism.pp=2", "--parallelism.pp_layers_per_stage=[1, 2]"], r"summing to the 4 layers"),
    (["--parallelism.pp=4", "--parallelism.pp_schedule=Interleaved1F1B"], "8 pipeline stages .* only 4 layers"),
    (["--parallelism.pp=2", "--parallelism.pp_microbatches=3"], "split into parallelism.pp_microbatches"),
    # torch's own schedule rules, checked before torch would raise them mid-setup
    (["--parallelism.pp=4", "--parallelism.pp_schedule=1F1B", "--parallelism.pp_microbatches=2"],
     "needs at least as many micro-batches as stages"),
    (["--parallelism.pp=2", "--parallelism.pp_schedule=Interleaved1F1B", "--parallelism.pp_microbatches=5",
      "--training.global_batch_size=20"], "must be a multiple of 2 rounds"),
    (["--parallelism.pp=2", "--parallelism.pp_schedule=ZBVZeroBubble", "--compile.enable=true"],
     "not support on compiled blocks"),
])
def test_tp_pp_rules(overrides, match):
    world = 1
    for o in overrides:
        if o.startswith(("--parallelism.tp=", "--parallelism.pp=")):
            world *= int(o.split("=")[1])
    with pytest.raises(ConfigError, match=match):
        _validate(world, "--parallelism.dp_shard=1", *overrides)


def test_tied_embeddings_are_refused_under_pp_only():
    # One matrix serving as embedding and output cannot live on two stages (PP); under TP the lookup and the
    # output projection both shard it on the vocabulary (tests/distributed/test_tp_pp.py trains it).
    tied = get_model_args("debug", tie_embeddings=True)
    cfg = load_job_config(DEBUG, ["--parallelism.dp_shard=1", "--parallelism.pp=2"])
    dims = ParallelDims(world_size=2, dp_shard=1, pp=2)
    with pytest.raises(ConfigError, match=r"^this Llama flavor ties the embedding and output weights, which live on "
                                          r"the first and last pipeline stages \(pp=2\); use pp=1 with it"):
        validate_job(cfg, dims, _llama(tied), 256)
    validate_job(cfg, dims, _llama(get_model_args("debug")), 256)
    cfg = load_job_config(DEBUG, ["--parallelism.dp_shard=1", "--parallelism.tp=2"])
    validate_job(cfg, ParallelDims(world_size=2, dp_shard=1, tp=2), _llama(tied), 256)


@pytest.mark.parametrize("schedule", pp_lib.V_SCHEDULES)
def test_v_schedules_on_gloo_refused_before_torch_2_13(monkeypatch, schedule):
    """torch 2.11 crashes on gloo at a V schedule's first step (it sends to its
    own rank): refused at setup there, in one line; allowed on NCCL."""
    args = ["--parallelism.dp_shard=1", "--parallelism.pp=2", f"--parallelism.pp_schedule={schedule}"]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(compat, "ZERO_BUBBLE_WITH_CHUNKED_LOSS", True)  # not the rule under test
    monkeypatch.setattr(compat, "V_SCHEDULES_ON_GLOO", False)
    cfg, _ = _validate(2, *args)  # a rule of the machine, not of the job: the planner plans it anywhere
    with pytest.raises(ConfigError, match="sends to its own rank, which gloo cannot do; use torch >= 2.13"):
        validate_machine(cfg, cpu)
    with pytest.raises(ConfigError, match="gloo cannot"):
        validate_machine(load_job_config(DEBUG, [*args, "--comm.backend=gloo"]), cuda)
    validate_machine(cfg, cuda)  # NCCL
    validate_machine(load_job_config(DEBUG, [*args[:2], "--parallelism.pp_schedule=Interleaved1F1B"]), cpu)
    monkeypatch.setattr(compat, "V_SCHEDULES_ON_GLOO", True)
    validate_machine(cfg, cpu)


@pytest.mark.parametrize("schedule", pp_lib.ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_with_chunked_loss_refused_before_torch_2_13(monkeypatch, schedule):
    """torch 2.11's zero-bubble input pass fails on the chunked loss's autograd
    Function: refused there in one line (whatever the backend), allowed unchunked."""
    monkeypatch.setattr(compat, "V_SCHEDULES_ON_GLOO", True)  # not the rule under test
    monkeypatch.setattr(compat, "ZERO_BUBBLE_WITH_CHUNKED_LOSS", False)
    args = ["--parallelism.dp_shard=1", "--parallelism.pp=2", f"--parallelism.pp_schedule={schedule}"]
    for device in ("cpu", "cuda"):
        with pytest.raises(ConfigError, match="input pass fails on the chunked loss.*loss.chunked = false"):
            validate_machine(load_job_config(DEBUG, args), torch.device(device))
        validate_machine(load_job_config(DEBUG, [*args, "--loss.chunked=false"]), torch.device(device))
    monkeypatch.setattr(compat, "ZERO_BUBBLE_WITH_CHUNKED_LOSS", True)
    validate_machine(load_job_config(DEBUG, args), torch.device("cpu"))


@pytest.mark.parametrize("schedule", pp_lib.ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_refuses_reshard_after_forward(schedule):
    """The trap: zero-bubble schedules + FSDP reshard_after_forward=True train
    silently wrong on torch 2.13. 'always' is refused; 'default' picks False."""
    with pytest.raises(ConfigError, match="trains silently wrong"):
        _validate(4, "--parallelism.pp=2", "--parallelism.dp_shard=2", f"--parallelism.pp_schedule={schedule}",
                  "--parallelism.fsdp_reshard_after_forward=always")
    cfg, dims = _validate(4, "--parallelism.pp=2", "--parallelism.dp_shard=2",
                          f"--parallelism.pp_schedule={schedule}")
    assert reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, dims.pp_enabled) is False
    # Non-zero-bubble schedules may reshard: they are exact either way.
    _validate(4, "--parallelism.pp=2", "--parallelism.dp_shard=2", "--parallelism.fsdp_reshard_after_forward=always")


@pytest.mark.parametrize("recipe, world, degrees", [
    ("llama3_8b", 8, {"dp_shard": 8, "tp": 1, "pp": 1}),
    ("llama3_70b", 64, {"dp_shard": 8, "tp": 8, "pp": 1}),
    ("llama3_405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}),
])
def test_llama3_recipes_pass_the_tp_pp_rules(recipe, world, degrees):
    cfg = load_job_config(str(RECIPES / f"{recipe}.toml"))
    par = cfg.parallelism
    dims = ParallelDims(world_size=world, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp,
                        tp=par.tp, pp=par.pp)
    validate_job(cfg, dims, _llama(get_model_args(cfg.model.flavor)), 128256)
    assert {k: dims.degrees()[k] for k in degrees} == degrees


