"""MetricsLogger: the metrics.jsonl contract, fields added by the loop, the console line and summary,
and the TensorBoard / W&B backends read back from their files."""

import importlib.util
import json
import math
import re
import struct

import pytest
import torch

from trainlib.config import ConfigError, load_job_config
from trainlib.metrics import MetricsConfig, MetricsLogger, scalars, setup_logging
from trainlib.train import train

CONTRACT = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "step_time_s", "tflops", "mfu", "peak_memory_gib")


def _cfg(tmp_path, *overrides):
    return load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.seq_len=64",
                                  "--training.global_batch_size=8", "--validation.steps=1", *overrides])


def test_added_fields_are_recorded_and_cannot_shadow_the_contract_only_some_are_printed(tmp_path, capsys):
    setup_logging(0)
    m = MetricsLogger(MetricsConfig(log_freq=1), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1, total_steps=10)
    m.step_done(1024)
    m.log(1, loss=2.0, grad_norm=0.5, lr=1e-3, val_loss=2.25, tokens_seen_per_dataset={"a": 1024}, other=3.0)
    with pytest.raises(TypeError, match=r"\['step_time_s'\] are built-in fields"):
        m.log(2, loss=2.0, grad_norm=0.5, lr=1e-3, step_time_s=1.0)
    m.close()
    (record,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(CONTRACT) <= set(record) and record["val_loss"] == 2.25 and record["other"] == 3.0
    assert record["tokens_seen"] == 1024
    line = capsys.readouterr().out.strip()
    assert line.startswith("[trainlib] step  1/10 | loss  2.0000 | grad_norm   0.500 | lr 1.00e-03 | tok/s ")
    assert "| val_loss 2.2500 |" in line and "other" not in line and "tokens_seen" not in line


def test_scalars_are_the_numeric_fields_with_dicts_flattened():
    record = {"step": 3, "time": 1.0, "loss": 2.0, "mfu": None, "mfu_basis": "bf16_peak", "tokens_seen": 10,
              "flag": True, "tokens_seen_per_dataset": {"web": 6, "/data/code.jsonl": 4}}
    assert scalars(record) == {"loss": 2.0, "tokens_seen": 10, "tokens_seen_per_dataset/web": 6,
                               "tokens_seen_per_dataset/data_code.jsonl": 4}


def test_console_lines_and_end_of_training_summary(tmp_path, capsys):
    # log every 2 steps, validation at step 3 (not a log step) and at the last step
    train(_cfg(tmp_path, "--training.steps=5", "--metrics.log_freq=2", "--validation.enable=true",
               "--validation.interval=3", "--checkpoint.enable=true", "--checkpoint.interval=4"))
    out = capsys.readouterr().out.splitlines()
    lines = [x for x in out if x.startswith("[trainlib] step ")]
    number = r"\s*[\d.,]+"
    pattern = (rf"\[trainlib\] step (\d)/5 \| loss{number} \| grad_norm{number} \| lr [\d.e+-]+ \| tok/s{number} \| "
               rf"tflops{number} \| mem{number} GiB( \| val_loss{number})? \| eta \d+:\d\d:\d\d")
    assert [re.fullmatch(pattern, x) is not None for x in lines] == [True] * 5, lines
    assert [re.fullmatch(pattern, x).group(1) for x in lines] == ["1", "2", "3", "4", "5"]
    assert ["val_loss" in x for x in lines] == [False, False, True, False, True]
    assert len({x.index("| tok/s") for x in lines}) == 1  # aligned
    (summary,) = [x for x in out if x.startswith("[trainlib] done: ")]
    assert re.fullmatch(r"\[trainlib\] done: 2,560 tokens in \d+:\d\d:\d\d wall, [\d,]+ tok/s mean, [\d.]+ TFLOP/s "
                        r"per device, MFU n/a \(no known peak for this device\); last checkpoint .*step-5", summary)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["tokens_seen"] for r in records] == [512 * s for s in (1, 2, 3, 4, 5)]
    assert math.isclose(records[2]["val_perplexity"], math.exp(records[2]["val_loss"]), rel_tol=1e-12)


def test_summary_without_checkpoint(tmp_path, capsys):
    train(_cfg(tmp_path, "--training.steps=1"))
    assert capsys.readouterr().out.rstrip().endswith("; no checkpoint")


def test_missing_backend_is_a_one_line_error_naming_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^metrics.enable_wandb = true needs the wandb package, which is not "
                                          r"installed: pip install 'trainlib\[wandb\]', or set"):
        train(_cfg(tmp_path, "--metrics.enable_wandb=true"))
    assert not (tmp_path / "metrics.jsonl").exists()  # before anything ran


def _tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_history(run_folder):
    """{step: {key: value}} from an offline run's transaction log (`run-<id>.wandb`): W&B's LevelDB-style
    log (a 7-byte header, then 32 KiB blocks of records, each with a 7-byte crc/length/type header;
    types 1 full, 2 first, 3 middle, 4 last), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, history = 7, b"", {}
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # block trailer
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of a block
            pos += room
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                history[items.pop("_step")] = items
    return history


def test_tensorboard_and_wandb_get_every_numeric_field_on_rank_0(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard", reason="pip install 'trainlib[tensorboard]' (in the dev extra)")
    wandb = pytest.importorskip("wandb", reason="pip install 'trainlib[wandb]' (in the dev extra)")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    inits, real_init = [], wandb.init
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or real_init(**kw))
    train(_cfg(tmp_path, "--training.steps=3", "--metrics.log_freq=1", "--metrics.console=false",
               "--metrics.enable_tensorboard=true", "--metrics.save_tb_folder=board",
               "--metrics.enable_wandb=true", "--metrics.wandb_mode=offline", "--metrics.wandb_project=proj",
               "--metrics.wandb_entity=team", "--validation.enable=true", "--validation.interval=2"))
    assert not [x for x in capsys.readouterr().out.splitlines() if x.startswith("[trainlib] step")]
    assert [(kw["project"], kw["entity"]) for kw in inits] == [("proj", "team")]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = {r["step"]: scalars(r) for r in records}
    assert {"val_loss", "val_perplexity", "tokens_seen", "peak_memory_gib"} <= set(expected[2])
    assert any(k.startswith("tokens_seen_per_dataset/") for k in expected[1])

    tb = _tensorboard_scalars(tmp_path / "board")
    assert set(tb) == set().union(*(e.keys() for e in expected.values()))
    for step, values in expected.items():
        for key, value in values.items():
            assert math.isclose(tb[key][step], value, rel_tol=1e-6), (key, step)  # stored as float32
    assert sorted(tb["val_loss"]) == [2, 3]

    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    history = _wandb_history(run)
    assert sorted(history) == [1, 2, 3]
    for step, values in expected.items():
        assert {k: v for k, v in history[step].items() if not k.startswith("_")} == values


def test_other_ranks_write_nothing(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'trainlib[tensorboard]' (in the dev extra)")
    m = MetricsLogger(MetricsConfig(enable_tensorboard=True), tmp_path, rank=1, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=2)
    m.step_done(1)
    m.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    m.close()
    assert list(tmp_path.iterdir()) == []


def test_non_finite_values_stay_valid_json_and_records_at_one_point_share_the_window(tmp_path, capsys):
    setup_logging(0)
    m = MetricsLogger(MetricsConfig(log_freq=1), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1)
    for _ in range(3):
        m.step_done(1000)
    # The guard logs an earlier event step, then the log step, with no step in between.
    event = m.log(2, loss=float("nan"), grad_norm=float("inf"), lr=1e-3, event="nonfinite")
    logged = m.log(3, loss=2.0, grad_norm=0.5, lr=1e-3)
    m.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0], parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl: not JSON"))
    assert (first["loss"], first["grad_norm"]) == (None, None)
    assert first["nonfinite"] == {"loss": "nan", "grad_norm": "inf"} and first["event"] == "nonfinite"
    assert "nonfinite" not in json.loads(lines[1])
    for key in ("tokens_per_second", "step_time_s", "tflops"):
        assert event[key] == logged[key] and logged[key] > 0, key
    event_line = capsys.readouterr().out.splitlines()[0]  # the console shows the values themselves
    assert "| loss     nan | grad_norm     inf |" in event_line and event_line.endswith("| nonfinite")


def test_step_time_and_tokens_per_second_cover_the_steps_since_the_last_record_without_untimed_work(
        tmp_path, monkeypatch):
    import trainlib.metrics as metrics_mod

    clock = [100.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: clock[0])
    m = MetricsLogger(MetricsConfig(log_freq=4), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=2, total_steps=8)
    for _ in range(4):  # four steps of 1.5 s and 3000 tokens each
        clock[0] += 1.5
        m.step_done(3000)
    with m.untimed():  # e.g. validation: 10 s that are not training
        clock[0] += 10.0
    r = m.log(4, loss=2.0, grad_norm=0.5, lr=1e-3)
    assert r["step_time_s"] == 1.5 and r["tokens_per_second"] == 2000.0
    assert r["tflops"] == 2000.0 / 2 * 1e6 / 1e12 and r["tokens_seen"] == 12000
    clock[0] += 7.0
    again = m.log(4, loss=2.0, grad_norm=0.5, lr=1e-3, val_loss=2.5)  # a second record of the same step
    assert (again["step_time_s"], again["tokens_per_second"]) == (1.5, 2000.0)
    clock[0] += 2.0
    m.step_done(1000)
    r = m.log(5, loss=2.0, grad_norm=0.5, lr=1e-3)  # the window restarts at the last record
    assert (r["step_time_s"], r["tokens_per_second"]) == (2.0, 500.0)
