"""What "auto" chooses: fused AdamW on CUDA, autocast instead of FSDP for bf16 on one rank,
and the one startup line that says so. CUDA is mocked where the choice depends on it."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from tests.helpers import build_on_one_rank
from trainlib.config import ConfigError, load_job_config
from trainlib.optim import OptimizerConfig, build_optimizer, implementation_of, kind_of, resolve_implementation
from trainlib.parallel import ParallelDims
from trainlib.parallel.mixed_precision import autocast_dtype, fsdp_wraps
from trainlib.train import train


def _on(device: str):
    return SimpleNamespace(device=torch.device(device))  # all resolve_implementation reads of a parameter


def test_auto_is_fused_when_every_parameter_is_on_cuda():
    assert resolve_implementation("auto", [_on("cuda:0"), _on("cuda:1")]) == "fused"
    assert resolve_implementation("auto", [_on("cpu")]) == "foreach"
    assert resolve_implementation("auto", [_on("cuda:0"), _on("cpu")]) == "foreach"  # e.g. FSDP CPU offload
    # Where the weights keep bf16 copies (autocast on one GPU), trainlib's AdamW writes them in its own pass.
    assert resolve_implementation("auto", [_on("cuda:0")], weight_copies=True) == "compiled"
    assert resolve_implementation("auto", [_on("cpu")], weight_copies=True) == "foreach"
    for explicit in ("foreach", "fused", "for-loop", "compiled"):  # an explicit value means what it always meant
        assert resolve_implementation(explicit, [_on("cuda:0")]) == explicit
        assert resolve_implementation(explicit, [_on("cpu")]) == explicit


@pytest.mark.parametrize("impl,expected", [("auto", "foreach"), ("foreach", "foreach"), ("fused", "fused"),
                                           ("for-loop", "for-loop")])
def test_built_optimizer_runs_the_resolved_implementation(impl, expected):
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer([model], OptimizerConfig(implementation=impl))
    assert implementation_of(opt) == expected
    assert OptimizerConfig().implementation == "auto"


@pytest.mark.parametrize("degrees,param,impl,expected", [
    ({}, torch.bfloat16, "auto", torch.bfloat16),  # one rank: autocast
    ({}, torch.bfloat16, "autocast", torch.bfloat16),
    ({}, torch.bfloat16, "fsdp", None),  # the former one-rank path, on request
    ({}, torch.float32, "auto", None),
    ({"dp_shard": 2}, torch.bfloat16, "auto", None),  # data parallel: FSDP casts
    ({"tp": 2, "dp_shard": 1}, torch.bfloat16, "auto", None),  # TP on one dp rank: FSDP's one-rank mesh
])
def test_autocast_only_on_one_rank(degrees, param, impl, expected):
    world = max(1, degrees.get("dp_shard", 1) * degrees.get("tp", 1))
    dims = ParallelDims(world_size=world, **degrees)
    assert autocast_dtype(dims, param, impl) == expected
    if expected is not None:
        assert not fsdp_wraps(dims, torch.float32)  # what build_model_parts asks under autocast


def test_autocast_on_several_ranks_is_a_one_line_error():
    with pytest.raises(ValueError, match="needs a job of one rank, but the world size is 2") as e:
        autocast_dtype(ParallelDims(world_size=2, dp_shard=2), torch.bfloat16, "autocast")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("impl,offload,reshard,reduce", [
    ("auto", False, "default", "float32"),
    ("fsdp", False, "default", "float32"),
    ("fsdp", False, "never", "bfloat16"),
    ("auto", True, "default", "float32"),
])
def test_one_rank_bf16_build(impl, offload, reshard, reduce, monkeypatch):
    import trainlib.parallel.fsdp as fsdp_mod

    received = {}  # module -> the keyword arguments its fully_shard call got (FSDP's state keeps them privately)
    shard = fsdp_mod.fully_shard

    def recorded(module, **kw):
        received[module] = kw
        return shard(module, **kw)

    monkeypatch.setattr(fsdp_mod, "fully_shard", recorded)
    cfg = load_job_config(None, ["--training.mixed_precision_param=bfloat16",
                                 f"--training.mixed_precision_impl={impl}", f"--parallelism.fsdp_cpu_offload={offload}",
                                 f"--parallelism.fsdp_reshard_after_forward={reshard}",
                                 f"--training.mixed_precision_reduce={reduce}"])
    built = build_on_one_rank(cfg)
    (model,) = built.parts
    if impl == "auto" and not offload:  # fp32 master weights, no FSDP, bf16 compute by autocast
        assert built.autocast_dtype == torch.bfloat16 and not isinstance(model, FSDPModule) and not received
    else:  # asked for, or needed by the CPU offload (FSDP's)
        assert built.autocast_dtype is None and isinstance(model, FSDPModule)
        # The FSDP keys as each block's fully_shard received them: on one rank (CPU) none of them changes the
        # numbers, so only the arguments show one ignored.
        for name, block in model.layers.items():
            kw = received[block]
            assert kw["reshard_after_forward"] is (reshard != "never"), name
            assert kw["mp_policy"].param_dtype == torch.bfloat16, name
            assert kw["mp_policy"].reduce_dtype == getattr(torch, reduce), name
            assert isinstance(kw["offload_policy"], CPUOffloadPolicy) is offload, name
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # FSDP's shards are fp32 too


def test_one_rank_build_follows_the_loss_keys():
    whole = build_on_one_rank(load_job_config(None, ["--loss.chunked=false"]))
    assert whole.loss_chunk_tokens is None and whole.parts[0].output_in_forward  # the model computes the logits
    chunked = build_on_one_rank(load_job_config(None, ["--loss.chunk_tokens=100",  # auto would be 256 on CPU
                                                       "--parallelism.tp_loss_parallel=false"]))
    assert chunked.loss_chunk_tokens == 100 and chunked.loss_fn.keywords["chunk_tokens"] == 100
    assert not chunked.parts[0].output_in_forward
    # Under TP the chunked loss, not the output layer, decides whether the logits' vocab shards are gathered.
    assert chunked.loss_fn.keywords["loss_parallel"] is False


def test_compile_backend_reaches_every_compiled_function(monkeypatch):
    backends = []

    def record(fn, **kwargs):  # nothing is compiled: only what trainlib asked for is of interest
        backends.append(kwargs.get("backend"))
        return fn

    monkeypatch.setattr("trainlib.parallel.compile.torch.compile", record)
    built = build_on_one_rank(load_job_config(None, ["--compile.enable=true", "--compile.loss=true",
                                                     "--compile.backend=aot_eager"]))
    assert backends == ["aot_eager"] * (built.model_args.n_layers + 1)  # each block, and the loss


def _cfg(tmp_path, *overrides):
    return load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.steps=6", "--training.seq_len=64",
                                  "--training.global_batch_size=8", "--metrics.log_freq=1", "--optimizer.lr=3e-3",
                                  "--training.mixed_precision_param=bfloat16", *overrides])


def test_autocast_trains_close_to_fsdp_bf16_and_says_so(tmp_path, capsys):
    # Measured on the debug recipe (python -m trainlib.parity ... 20 steps, docs/performance.md): autocast within
    # 7.7e-4 of FSDP-bf16 and within 1.1e-4 of fp32 (it keeps the residual stream and norms in fp32).
    autocast = train(_cfg(tmp_path / "a"))
    line = [x for x in capsys.readouterr().out.splitlines() if "chosen:" in x]
    assert line == ["[trainlib] chosen: adamw foreach (auto) | bfloat16 autocast over fp32 weights (auto), one "
                    "bfloat16 weight copy per step | loss chunked by 256 tokens (auto) | AC none | eager | no float8"], line
    fsdp = train(_cfg(tmp_path / "b", "--training.mixed_precision_impl=fsdp"))
    assert "bfloat16 params by FSDP, float32 reduce" in capsys.readouterr().out
    fp32 = train(_cfg(tmp_path / "c", "--training.mixed_precision_param=float32"))
    for a, f, f32 in zip(autocast, fsdp, fp32):
        assert a["loss"] != f["loss"] and a["loss"] != f32["loss"]  # really another path, really bf16
        assert math.isclose(a["loss"], f["loss"], rel_tol=2e-3), (a["step"], a["loss"], f["loss"])
    assert autocast[-1]["loss"] < autocast[0]["loss"] - 0.5  # it learns


@pytest.mark.parametrize("overrides,line", [
    ([], "adamw foreach (auto) | float32 | loss chunked by 256 tokens (auto) | AC none | eager | no float8"),
    (["--optimizer.implementation=for-loop", "--loss.chunked=false", "--activation_checkpoint.mode=selective_op",
      "--activation_checkpoint.selective_op_policy=every_other_mm", "--compile.enable=true", "--compile.loss=true"],
     "adamw for-loop | float32 | loss on whole logits | AC selective_op (every_other_mm) | compile blocks + loss | "
     "no float8"),
    (["--loss.chunk_tokens=64", "--activation_checkpoint.mode=full", "--compile.enable=true",
      "--float8.enable=true", "--float8.emulate=true", "--float8.recipe=rowwise", "--float8.min_size=0"],
     "adamw foreach (auto) | float32 | loss chunked by 64 tokens | AC full | compile blocks | float8 rowwise"),
])
def test_the_chosen_line_names_each_setting(monkeypatch, overrides, line):
    from trainlib.build import describe_choices

    monkeypatch.setattr("trainlib.parallel.compile.torch.compile", lambda fn, **kw: fn)  # named, not run
    cfg = load_job_config(None, overrides)
    built = build_on_one_rank(cfg)
    optimizer = build_optimizer(built.parts, cfg.optimizer)
    assert describe_choices(cfg, built, kind_of(optimizer).describe(optimizer, cfg.optimizer)) == "chosen: " + line


def test_chunked_loss_refuses_a_float8_output_layer():
    cfg = load_job_config(None, ["--float8.enable=true", "--float8.emulate=true", "--float8.filter_fqns=[]",
                                 "--float8.min_size=0"])
    with pytest.raises(ConfigError, match=r"^loss.chunked applies the output projection's weight .* the output layer "
                                          r"is a Float8Linear \(float8.filter_fqns=\[\] does not exclude 'output'\); "
                                          r"add 'output' to float8.filter_fqns or set loss.chunked=false$"):
        build_on_one_rank(cfg)
