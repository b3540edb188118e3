"""The planner's exact state bytes against the tensors of a real run on gloo ranks."""

import json

import pytest
import torch

from tests.helpers import RECIPES, spawn
from trainlib.plan import make_plan

DEBUG = str(RECIPES / "debug.toml")


def _allocated(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors):
    what the run really allocated, counted independently of the planner."""
    from torch.distributed.tensor import DTensor

    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _real_state(rank, world, out_dir, overrides):
    import torch.distributed as dist

    from trainlib.config import load_job_config
    from trainlib.distributed import init_distributed
    from trainlib.loss import count_targets
    from trainlib.train import forward_backward, setup

    cfg = load_job_config(DEBUG, overrides + [f"--job.dump_folder={out_dir}/run", "--job.device=cpu",
                                              "--training.steps=1"])
    job = setup(cfg, init_distributed(cfg.comm, cfg.job.device))
    micro = [next(job.loader) for _ in range(job.grad_accum)]
    n = sum(count_targets(mb["labels"]) for mb in micro).to(torch.float32)
    dist.all_reduce(n, group=job.dims.mesh("dp").get_group())
    forward_backward(job, micro, n)
    params = list({id(p): p for m in job.model_parts for p in m.parameters()}.values())
    job.optimizer.step()
    got = {"params": _allocated(params), "grads": _allocated(p.grad for p in params),
           "optimizer": _allocated(v for s in job.optimizer.state.values() for v in s.values()),
           "pp_rank": job.dims.mesh("pp").get_local_rank()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(got, f)


def _check_state(tmp_path, world, overrides):
    spawn(_real_state, world, str(tmp_path), overrides)
    plan = make_plan(DEBUG, world, overrides=overrides)
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        want = plan.stages[got["pp_rank"]].memory
        assert {k: got[k] for k in ("params", "grads", "optimizer")} == \
            {k: want[k] for k in ("params", "grads", "optimizer")}, f"rank {r}"
        assert got["params"] > 0 and got["optimizer"] > 2 * got["params"]


def test_state_bytes_equal_a_real_fsdp_run(tmp_path):
    # bf16 mixed precision: FSDP keeps fp32 sharded parameters, gradients and AdamW state.
    _check_state(tmp_path, 2, ["--training.mixed_precision_param=bfloat16"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--parallelism.tp=2"], ["--parallelism.pp=2", "--parallelism.tp=2"],
                                    ["--parallelism.dp_replicate=2"]])
def test_state_bytes_equal_a_real_run_tp_pp(tmp_path, layout):
    _check_state(tmp_path, 4, layout + ["--training.mixed_precision_param=bfloat16"])
