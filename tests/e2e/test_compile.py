"""torch.compile per block (inductor's C++ backend on CPU), composed with AC,
float8 and FSDP, against the eager curve.

Compiling is the expensive part of this suite (12-30 s for the first block
graph on 2 cores), so there are few compiled runs; inductor's cache
(/tmp/torchinductor_$USER by default) keeps later runs of the suite warm.

Agreeing with eager proves nothing on its own (an ignored compile.enable
agrees perfectly), so each test also counts what Dynamo compiled, from the
job's own log (TORCH_LOGS=dynamo: one "start tracing" line per frame, one
"done compiler function" per graph handed to inductor).
"""

import re

import pytest

from tests.helpers import RECIPES, needs_cxx_compiler
from trainlib.parity import default_pool, run_parity

SMALL = ["--training.global_batch_size=4", "--training.seq_len=128"]

# Inductor fuses and reorders fp32 arithmetic; on the debug model the compiled
# curve stayed within ~1e-7 relative of eager over 10 steps (measured); 1e-5
# is the library's usual parity bar.
COMPILE_RTOL = 1e-5



@pytest.fixture(autouse=True)
def _fresh_processes():
    """TORCH_LOGS is read when torch is imported: these runs need processes of their own, not the
    session's long-lived parity workers."""
    with default_pool(None):
        yield


_TRACED = re.compile(r"\[(\d+)/(\d+)\] Step 1: torchdynamo start tracing (\S+) (\S+):\d+")
_COMPILED = re.compile(r"\[(\d+)/(\d+)\] Step 2: done compiler function inductor")


def compiled_graphs(output: str) -> list[str]:
    """What inductor compiled in one process: 'block' or 'loss' per graph (recompiles included)."""
    traced = {m.group(1, 2): (m[3], m[4]) for m in _TRACED.finditer(output)}
    kinds = []
    for frame in sorted({m.group(1, 2) for m in _COMPILED.finditer(output)}):
        fn, path = traced[frame]
        # A block is its forward, or its AC wrapper's when checkpointing wraps it before compile.
        if fn == "forward" and path.endswith(("llama3/model.py", "_checkpoint/checkpoint_wrapper.py")):
            kinds.append("block")
        elif fn == "cross_entropy_sum":
            kinds.append("loss")
        else:
            kinds.append(f"{fn} ({path})")
    return kinds


@needs_cxx_compiler
def test_compiled_blocks_and_loss_match_eager(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")  # read by the jobs parity starts
    # With selective-op AC: compile runs after AC wrapping, so the compiled
    # graph contains the checkpoint region and its save/recompute policy.
    report = run_parity(str(RECIPES / "debug.toml"), [
        "compile.enable=true,compile.loss=true,activation_checkpoint.mode=selective_op",
    ], steps=10, extra=SMALL)
    print(report.table())
    assert compiled_graphs(report.baseline.output) == []
    # One graph serves all 4 blocks (same code and shapes, parameters as inputs),
    # one the loss; no recompiles over 10 steps.
    assert compiled_graphs(report.runs[0].output) == ["block", "loss"], report.runs[0].output[-3000:]
    assert report.max_rel_loss < COMPILE_RTOL
    assert report.max_rel_grad_norm < COMPILE_RTOL


@pytest.mark.slow
@needs_cxx_compiler
def test_compiled_fsdp_float8_full_ac_matches_eager_float8(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    # Baseline: eager float8 on 2 ranks, so only compile (and AC) differ.
    f8 = "dp_shard=2,float8.enable=true"
    report = run_parity(str(RECIPES / "debug.toml"), [
        f8 + ",compile.enable=true,activation_checkpoint.mode=full",
    ], steps=10, extra=SMALL, baseline=f8)
    print(report.table())
    assert compiled_graphs(report.baseline.output) == []
    # Both ranks log (as [rank0]: / [rank1]:); blocks only, compile.loss is off.
    assert set(compiled_graphs(report.runs[0].output)) == {"block"}, report.runs[0].output[-3000:]
    # Measured 2.2e-7. float8 casts can amplify inductor's fp32 reordering (a
    # value on either side of an e4m3 rounding boundary moves by 1/16), hence
    # a looser bound than fp32's, still far below float8's own 1e-3 effect.
    assert report.max_rel_loss < 1e-4


@pytest.mark.slow
@needs_cxx_compiler
def test_compiled_ulysses_and_hybrid_cp_with_float8_and_ac_match_eager(monkeypatch):
    """Ulysses' all-to-alls (functional collectives with autograd) inside each compiled block graph, no
    graph break, under float8 and full AC, against the same layouts eager (issue 45: CP methods compose
    with compile, AC and float8)."""
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    for layout in ("cp=2,cp_method=ulysses", "cp=4,cp_method=hybrid,cp_ulysses=2"):
        eager = f"{layout},float8.enable=true"
        report = run_parity(str(RECIPES / "debug.toml"), [eager + ",compile.enable=true,activation_checkpoint.mode=full"],
                            steps=6, extra=SMALL, baseline=eager)
        print(report.table())
        assert compiled_graphs(report.baseline.output) == []
        # Every rank logs its own graphs (as [rankN]:); a break at the all-to-all would add resume frames.
        assert set(compiled_graphs(report.runs[0].output)) == {"block"}, report.runs[0].output[-3000:]
        assert report.max_rel_loss < 1e-4, layout


def rank0_compiled_frames(output: str) -> set[tuple[str, str]]:
    """The frames inductor compiled in rank 0 of a torchrun job (its lines carry "[rank0]:")."""
    return {m.group(1, 2) for line in output.splitlines() if "[rank0]:" in line for m in _COMPILED.finditer(line)}


@pytest.mark.slow
@needs_cxx_compiler
def test_compiled_moe_with_expert_parallel_matches_eager(monkeypatch):
    """debug_moe (a dense block, then MoE blocks) under EP 2 with inductor and full AC against EP 2 eager,
    the global-batch auxiliary loss on (a loss term a compiled graph once dropped the gradient of). An MoE
    block compiles in two graphs around its routed experts (MoE._routed runs eager: routing-dependent
    shapes), the dense block in one."""
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    eager = "dp_shard=2,ep=2"
    report = run_parity(str(RECIPES / "debug_moe.toml"), [eager + ",compile.enable=true,activation_checkpoint.mode=full"],
                        steps=6, extra=[*SMALL, "--moe.global_aux_loss_coef=0.01"], baseline=eager)
    print(report.table())
    assert compiled_graphs(report.baseline.output) == []
    frames = rank0_compiled_frames(report.runs[0].output)
    assert len(frames) == 3, report.runs[0].output[-3000:]  # the dense block, an MoE block's two halves
    assert report.max_rel_loss < 1e-5 and report.max_rel_grad_norm < 1e-4
