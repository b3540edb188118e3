"""The loop in-process (world of one): loss semantics, accumulation, outputs."""

import json
import math

import pytest
import torch

from trainlib.config import ConfigError, load_job_config
from trainlib.loss import cross_entropy_sum
from trainlib.train import train

CONTRACT = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "step_time_s", "tflops", "mfu", "peak_memory_gib")

def _cfg(tmp_path, *overrides):
    return load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.steps=8", "--training.seq_len=64",
                                  "--training.global_batch_size=8", "--metrics.log_freq=1",
                                  "--metrics.console=false", "--optimizer.lr=3e-3", *overrides])


def test_grad_accumulation_matches_single_micro_batch(tmp_path, monkeypatch):
    import trainlib.train as loop

    # What the loop passed on, per step: equal curves alone would also come from a local_batch_size ignored.
    micro_batches, max_norms, timeouts, optimizers = [], [], [], []
    real_forward_backward, real_clip = loop.forward_backward, loop.clip_grad_norm_

    def forward_backward(job, mbs, n_targets):
        micro_batches.append(len(mbs))
        return real_forward_backward(job, mbs, n_targets)

    def clip_grad_norm_(params, max_norm, *rest, **kw):
        max_norms.append(max_norm)
        optimizers.append(kw.get("optimizer"))  # the clip may be left to a fused AdamW's step
        return real_clip(params, max_norm, *rest, **kw)

    monkeypatch.setattr(loop, "forward_backward", forward_backward)
    monkeypatch.setattr(loop, "clip_grad_norm_", clip_grad_norm_)
    monkeypatch.setattr(loop, "set_collective_timeout", timeouts.append)  # one rank: no collective to time out

    one = train(_cfg(tmp_path / "a"))
    assert micro_batches == [1] * 8
    micro_batches.clear()
    four = train(_cfg(tmp_path / "b", "--training.local_batch_size=2"))  # 4 micro-steps
    assert micro_batches == [4] * 8
    assert len(one) == len(four) == 8
    for r1, r4 in zip(one, four):
        assert math.isclose(r1["loss"], r4["loss"], rel_tol=1e-5), (r1["step"], r1["loss"], r4["loss"])
        assert math.isclose(r1["grad_norm"], r4["grad_norm"], rel_tol=1e-5)

    # One step more, against `one`'s first (seed 0, the same data): the keys the loop itself reads.
    max_norms.clear()
    timeouts.clear()
    optimizers.clear()
    # 100 s: a timeout below 2 x watchdog.min_seconds (30) is refused at setup.
    reseeded = train(_cfg(tmp_path / "c", "--training.steps=1", "--training.seed=1", "--training.max_norm=0.5",
                          "--comm.train_timeout_seconds=100"))
    assert reseeded[0]["loss"] != one[0]["loss"]  # other initial weights
    assert max_norms == [0.5] and timeouts == [100]
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.AdamW)


def test_outputs_metrics_contract_and_config(tmp_path):
    records = train(_cfg(tmp_path, "--training.steps=30"))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 31))
    for r in lines:
        assert set(CONTRACT) <= set(r)
        assert r["mfu"] is None  # CPU peak is unknown
        assert r["tokens_per_second"] > 0 and r["peak_memory_gib"] > 0
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0  # it learns
    assert records[-1]["loss"] == lines[-1]["loss"]
    saved = (tmp_path / "config.toml").read_text()
    assert "global_batch_size = 8" in saved and 'flavor = "debug"' in saved
    reloaded = load_job_config(str(tmp_path / "config.toml"))
    assert reloaded.training.steps == 30


def test_bf16_mixed_precision_runs_close_to_fp32(tmp_path):
    fp32 = train(_cfg(tmp_path / "a", "--training.steps=4"))
    bf16 = train(_cfg(tmp_path / "b", "--training.steps=4", "--training.mixed_precision_param=bfloat16"))
    for a, b in zip(fp32, bf16):
        assert a["loss"] != b["loss"]  # really ran in another precision
        assert math.isclose(a["loss"], b["loss"], rel_tol=2e-2)


def test_loss_is_token_weighted_global_mean():
    # Two micro-batches with different numbers of targets: summing per-token
    # losses and dividing once by the global count is the true mean; averaging
    # per-micro-batch means is not.
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    labels[1, 2:] = -100
    n = (labels != -100).sum()
    split = (cross_entropy_sum(logits[:1], labels[:1]) + cross_entropy_sum(logits[1:], labels[1:])) / n
    full = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(split, full)


@pytest.mark.parametrize("overrides,match", [
    (["--training.global_batch_size=6", "--training.local_batch_size=4"], "multiple of training.local_batch_size"),
    (["--model.vocab_size=100"], "tokenizer vocabulary .258. is larger"),
    (["--parallelism.tp=2"], "world size 1 is not divisible"),
    (["--parallelism.tp=2", "--parallelism.dp_shard=1"], r"= 2 != world size 1"),
    (["--model.flavor=llama3.1_8"], "did you mean 'llama3.1_8b'"),
    # FSDP's CPU offload where FSDP does not wrap the model would be silently ignored.
    (["--parallelism.fsdp_cpu_offload=true"], r"fsdp_cpu_offload .* but this job has no FSDP: .*= 1 here"),
    (["--parallelism.fsdp_cpu_offload=true", "--training.mixed_precision_param=bfloat16",
      "--training.mixed_precision_impl=autocast"], "this job has no FSDP"),
])
def test_setup_errors_are_config_errors(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        train(_cfg(tmp_path, *overrides))




def test_job_close_stops_what_setup_started(tmp_path):
    """Job.close() (train()'s teardown, and a custom loop's) ends every thread setup started (the hang
    watchdog, the prefetch threads of the training and validation loaders) and gives back the SIGTERM
    handler and the garbage collector. A thread left running can abort the process at exit: the distributed
    validation test, which listed the closes itself and missed the watchdog, died so in CI now and then."""
    import gc
    import signal
    import threading

    from tests.helpers import short_documents_corpus
    from trainlib.data.prepare import prepare
    from trainlib.distributed import destroy_distributed, init_distributed
    from trainlib.train import setup, train_loop

    prepare(str(tmp_path / "prep"), [str(short_documents_corpus(tmp_path / "docs.jsonl", n_docs=200))],
            progress=False)
    cfg = _cfg(tmp_path / "run", "--training.steps=2", f"--data.path={tmp_path / 'prep'}", "--validation.enable=true",
               "--validation.steps=1", f"--validation.data.path={tmp_path / 'prep'}")
    handler, gc_enabled = signal.getsignal(signal.SIGTERM), gc.isenabled()
    job = setup(cfg, init_distributed(cfg.comm, cfg.job.device))
    try:
        train_loop(job)
        started = sorted(t.name for t in threading.enumerate() if t.name.startswith("trainlib-"))
        assert started == ["trainlib-data-prefetch"] * 2 + ["trainlib-watchdog"], started  # training, validation
        assert signal.getsignal(signal.SIGTERM) != handler and not gc.isenabled()
        job.close()
    finally:
        destroy_distributed()
    assert [t.name for t in threading.enumerate() if t.name.startswith("trainlib-")] == []
    assert signal.getsignal(signal.SIGTERM) == handler and gc.isenabled() == gc_enabled


def test_a_finished_run_relaunched_says_nothing_to_train(tmp_path, capfd):
    train(_cfg(tmp_path, "--training.steps=2", "--checkpoint.enable=true"))
    lines = (tmp_path / "metrics.jsonl").read_text()
    assert "nothing to train" not in capfd.readouterr().out
    assert train(_cfg(tmp_path, "--training.steps=2", "--checkpoint.enable=true")) == []
    assert "nothing to train: the run folder's checkpoint is at step 2 and training.steps = 2" in capfd.readouterr().out
    assert (tmp_path / "metrics.jsonl").read_text() == lines  # the run's history untouched


def test_a_refused_launch_writes_nothing(tmp_path, capfd):
    # issue 54 item 5: a dense checkpoint resumed as an MoE run was refused after config.toml was rewritten
    # (the report then labelled the earlier run with the refused run's settings) and a refused launch into a
    # new folder left the folder and its lock behind.
    run = tmp_path / "run"
    train(_cfg(run, "--training.steps=2", "--checkpoint.enable=true", "--model.name=qwen3", "--model.flavor=debug"))
    before = {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    with pytest.raises(ConfigError, match="checkpoint"):
        train(_cfg(run, "--training.steps=4", "--checkpoint.enable=true", "--model.name=qwen3_moe",
                   "--model.flavor=debug_moe"))
    after = {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert after == before  # config.toml, metrics.jsonl, the lock: as the earlier run left them, nothing new
    fresh = tmp_path / "new" / "run"
    with pytest.raises(ConfigError, match="needs about"):  # refused by the memory check, after the folder's
        train(_cfg(fresh, "--training.seq_len=1000000"))
    assert not (tmp_path / "new").exists()  # no folder, no lock, no config.toml


def test_an_hf_export_that_cannot_be_written_is_refused_at_start_up(tmp_path):
    # issue 54 item 3: checkpoint.export_hf's folder (and whether HF's format holds the model) were found
    # out after training
    (tmp_path / "hf").write_text("a file where the export goes")
    with pytest.raises(ConfigError, match=r"checkpoint.export_hf = '\S+hf': \S+hf is a file, not a folder"):
        train(_cfg(tmp_path, "--checkpoint.enable=true", "--checkpoint.export_hf=true"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing trained, nothing written
