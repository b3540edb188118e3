"""Activation checkpointing composed with TP (+SP) and FSDP keeps the
single-process curve: recomputation replays the same kernels on the same
inputs, collectives included. (Unit tests check bitwise-equal gradients and
the memory saved on one process: tests/unit/test_ac.py.)"""

from tests.helpers import RECIPES
from trainlib.parity import run_parity

TOL = 1e-5  # the library's parity bar (fp32 on CPU)


def test_ac_under_tp_and_fsdp_matches_single_process():
    report = run_parity(str(RECIPES / "debug.toml"), [
        "tp=2,activation_checkpoint.mode=selective_op,activation_checkpoint.selective_op_policy=every_other_mm",
        "tp=2,activation_checkpoint.mode=full",
        "dp_shard=2,activation_checkpoint.mode=selective_layer,activation_checkpoint.every_k=3",
    ], steps=5, extra=["--training.global_batch_size=4", "--training.seq_len=128"])
    print(report.table())
    # The job's own account of what it wrapped (debug model: 4 blocks). Neither key at its default (all_mm;
    # every_k=2 wraps blocks 0, 2), so a key dropped on its way to apply_ac shows here.
    for run, line in zip(report.runs, ["activation checkpointing selective_op (every_other_mm): blocks 0, 1, 2, 3 of 4",
                                       "activation checkpointing full: blocks 0, 1, 2, 3 of 4",
                                       "activation checkpointing selective_layer: blocks 0, 3 of 4"]):
        assert line in run.output, run.output[-2000:]
    for run in report.runs:
        assert run.max_rel_loss <= TOL, (run.name, run.max_rel_loss)
        assert run.max_rel_grad_norm <= TOL, (run.name, run.max_rel_grad_norm)
