"""Validation under parallel layouts: the loss of one process, and a training curve it leaves bitwise alone."""

import json

import pytest

from tests.helpers import gloo_schedules, spawn
from trainlib.config import load_job_config
from trainlib.distributed import init_distributed
from trainlib.train import setup, train, train_loop

TOL = 1e-5  # relative, fp32 on CPU
STEPS = 2
LAYOUTS = {  # world 2
    "FSDP2": {"dp_shard": 2},
    "PP2 ZBVZeroBubble": {"pp": 2, "pp_schedule": "ZBVZeroBubble"},  # V placement: two stages on a rank
    "TP2": {"tp": 2},
    "CP2": {"cp": 2},
    "CP2 contiguous": {"cp": 2, "cp_load_balance": False},  # the key reaches validation's batch split
    "PP2 1F1B": {"pp": 2, "pp_schedule": "1F1B"},
    "PP2 Interleaved1F1B": {"pp": 2, "pp_schedule": "Interleaved1F1B"},
    "PP2 DualPipeV": {"pp": 2, "pp_schedule": "DualPipeV"},
}
RUNNABLE = [n for n, d in LAYOUTS.items() if d.get("pp_schedule", "1F1B") in gloo_schedules()]
# torch < 2.13 cannot run V placements on gloo: Interleaved1F1B stands in as the multi-stage rank
FAST = ["FSDP2", "PP2 ZBVZeroBubble" if "PP2 ZBVZeroBubble" in RUNNABLE else "PP2 Interleaved1F1B"]


def _cfg(folder, layout=None, validation=True):
    degrees = {"dp_shard": 1, **(layout or {})}
    return load_job_config(None, [
        f"--job.dump_folder={folder}", f"--training.steps={STEPS}", "--training.seq_len=64",
        "--training.global_batch_size=8", "--metrics.log_freq=1", "--metrics.console=false",
        f"--validation.enable={validation}", "--validation.interval=1", "--validation.steps=2",
        "--model.n_layers=4", *(f"--parallelism.{k}={v}" for k, v in degrees.items())])


def _run(cfg):
    # train() without its process-group teardown, so one spawn runs every layout
    from torch.distributed.tensor import DTensor

    job = setup(cfg, init_distributed(cfg.comm, cfg.job.device))
    try:
        records = train_loop(job)
        if job.dims.dp_shard > 1:  # the last step's validation left FSDP's parameters sharded, as training does
            unsharded = [n for part in job.model_parts for n, p in part.named_parameters()
                         if not isinstance(p, DTensor)]
            assert not unsharded, unsharded
        return records
    finally:
        job.close()


def _layouts(rank, world, out, names, bitwise):
    results = {}
    for name in names:
        results[name] = [[r.get("val_loss"), r["loss"], r["grad_norm"]]
                         for r in _run(_cfg(f"{out}/{rank}", LAYOUTS[name]))]
        if bitwise:  # the same run without validation
            plain = _run(_cfg(f"{out}/{rank}", LAYOUTS[name], validation=False))
            results[name + " without validation"] = [[None, r["loss"], r["grad_norm"]] for r in plain]
    if rank == 0:
        with open(f"{out}/results.json", "w") as f:
            json.dump(results, f)


def _check(tmp_path, names, bitwise):
    base = [[r["val_loss"], r["loss"], r["grad_norm"]] for r in train(_cfg(tmp_path / "single"))]
    assert len(base) == STEPS and all(v is not None for v, _, _ in base)
    assert base[1][0] < base[0][0]  # held-out loss goes down with training
    spawn(_layouts, 2, str(tmp_path), names, bitwise)
    results = json.loads((tmp_path / "results.json").read_text())
    for name in names:
        for (val, loss, _), (val0, loss0, _) in zip(results[name], base):
            assert abs(val - val0) <= TOL * val0, (name, val, val0)
            assert abs(loss - loss0) <= TOL * loss0, (name, loss, loss0)
        if bitwise:  # == on floats: validation changed nothing in training, not even rounding
            assert [r[1:] for r in results[name]] == [r[1:] for r in results[name + " without validation"]], name


def test_validation_loss_matches_one_process_and_leaves_training_bitwise_alone(tmp_path):
    _check(tmp_path, FAST, bitwise=True)


@pytest.mark.slow
def test_validation_under_tp_cp_and_every_pipeline_placement(tmp_path):
    _check(tmp_path, [n for n in RUNNABLE if n not in FAST], bitwise=True)
