"""The planner (trainlib.plan): exact state bytes against a real run, activation
estimate against measured saved tensors, TorchTitan's published H100 memory,
the job's own errors, and the CLI."""

import json

import pytest
import torch

from tests.helpers import RECIPES
from trainlib.models.llama3 import Transformer, get_model_args
from trainlib.parallel.ac import apply_ac
from trainlib.plan import (
    GiB,
    block_activation_bytes_per_token,
    main,
    make_plan,
    suggest,
)

DEBUG = str(RECIPES / "debug.toml")

def _saved_bytes(args, mode, batch, seq, dtype):
    """Bytes of the distinct storages autograd saves in one forward of the blocks
    (parameters and the rope table excluded)."""
    model = Transformer(args, rope_len=seq).to(dtype)
    apply_ac(model, mode)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}
    x = torch.randn(batch, seq, args.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in model.layers.values():
            x = layer(x, model.rope)
    return sum(v for k, v in seen.items() if k not in skip)


@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_within_25_percent(mode, dtype):
    args = get_model_args("debug", n_layers=3)
    batch, seq = 2, 128
    measured = _saved_bytes(args, mode, batch, seq, dtype)
    elem = torch.finfo(dtype).bits // 8
    est = args.n_layers * batch * seq * block_activation_bytes_per_token(args, tp=1, sp=False, elem=elem, mode=mode)
    assert abs(est - measured) <= 0.25 * measured, (est, measured)


def test_plan_activations_match_whole_model_forward():
    """The planner's whole-stage activation figure (blocks, token ids, final norm,
    output input) against one measured forward of the debug model, fp32."""
    plan = make_plan(DEBUG, 1, overrides=["training.global_batch_size=4", "training.seq_len=128"])
    args = get_model_args("debug")
    model = Transformer(args, rope_len=128)
    seen = {}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {model.rope.untyped_storage().data_ptr()}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, args.vocab_size, (4, 128)))
    measured = sum(v for k, v in seen.items() if k not in skip)
    est = plan.stages[0].memory["activations"]
    assert abs(est - measured) <= 0.25 * measured, (est, measured)


# (recipe, world, overrides matching the published run, published GiB range)
PUBLISHED = {
    # Table 1: FSDP 8, local batch 2, seq 8192, selective (op) AC. TorchTitan's op
    # policy saves every other matmul output: our every_other_mm.
    "8b": ("llama3_8b.toml", 8, ["activation_checkpoint.mode=selective_op",
                                 "activation_checkpoint.selective_op_policy=every_other_mm"], (77.0, 82.4)),
    # Table 4: FSDP 32 x TP 8, local batch 16, full AC.
    "70b": ("llama3_70b.toml", 256, ["activation_checkpoint.mode=full"], (67.6, 71.9)),
    # Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, full AC, micro-batch 1
    # (TorchTitan's default), 1F1B or Interleaved 1F1B.
    "405b": ("llama3_405b.toml", 512, ["activation_checkpoint.mode=full", "parallelism.pp_microbatches=32"],
             (72.7, 82.5)),
}

@pytest.mark.parametrize("name", list(PUBLISHED))
def test_torchtitan_published_memory_within_20_percent(name):
    recipe, world, overrides, (lo, hi) = PUBLISHED[name]
    plan = make_plan(str(RECIPES / recipe), world, "h100", overrides)
    mid = (lo + hi) / 2
    got = plan.max_total_bytes / GiB
    assert abs(got - mid) <= 0.2 * mid, f"{name}: predicted {got:.1f} GiB, published {lo}-{hi} GiB"
    assert plan.world_size == world and plan.degrees["dp_shard"] * plan.degrees["tp"] * plan.degrees["pp"] == world


def test_gpu_memory_sets_the_warning():
    over = ["activation_checkpoint.mode=selective_op"]  # ~100 GiB per GPU
    assert not make_plan(str(RECIPES / "llama3_8b.toml"), 8, "h100", over).fits
    assert make_plan(str(RECIPES / "llama3_8b.toml"), 8, "h200", over).fits


def test_405b_without_ac_warns_it_does_not_fit():
    over = ["activation_checkpoint.mode=none", "parallelism.pp=4", "parallelism.pp_microbatches=4",
            "training.global_batch_size=512"]
    plan = make_plan(str(RECIPES / "llama3_405b.toml"), 512, "h100", over)
    assert not plan.fits and "exceeds" in plan.warnings[0]
    assert len(plan.stages) == 4 and plan.stages[0].has_embedding and plan.stages[-1].has_output


@pytest.mark.parametrize("world, overrides, words", [
    (6, ["parallelism.tp=4"], "not divisible"),
    (8, ["parallelism.tp=4"], "n_kv_heads (2) must be divisible by parallelism.tp (4)"),
    (8, ["parallelism.pp=8"], "exceeds the number of layers"),
    (4, ["parallelism.pp=2", "parallelism.pp_layers_per_stage=[1,1]"], "pp_layers_per_stage"),
    (2, ["training.global_batch_size=3"], "global_batch_size (3)"),
])
def test_bad_layouts_give_the_jobs_one_line_errors(world, overrides, words):
    with pytest.raises(ValueError) as e:
        make_plan(DEBUG, world, overrides=overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_cli_table_json_and_error(capsys):
    assert main(["--recipe", DEBUG, "--world-size", "4", "--set", "parallelism.tp=2"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out and "tp=" in out and "predicted step" in out
    assert main(["--recipe", DEBUG, "--world-size", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["degrees"]["dp_shard"] == 2 and data["stages"][0]["memory"]["params"] > 0
    assert main(["--recipe", DEBUG, "--world-size", "3", "--set", "parallelism.tp=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainlib.plan: error:") and err.count("\n") == 1


def test_suggest_ranks_fitting_layouts_by_step_time():
    rows = suggest(DEBUG, 8, "h100", top=50)
    assert rows and all(r["peak_gib"] <= 80 for r in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert all(r["tp"] * r["pp"] * r["cp"] * r["dp_replicate"] * r["dp_shard"] == 8 for r in rows)
    assert {r["tp"] for r in rows} == {1, 2}  # tp divides the 2 kv heads


def test_every_shipped_recipe_plans_and_fits_its_target_cluster():
    from tests.unit.test_recipes import WORLD

    for name, world in WORLD.items():
        plan = make_plan(str(RECIPES / name), world, "h100")
        assert plan.fits, f"{name} on {world} GPUs: {plan.max_total_bytes / GiB:.1f} GiB"
        assert name == "debug.toml" or plan.model.startswith("llama3.")


