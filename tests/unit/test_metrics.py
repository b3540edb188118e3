"""MetricsLogger: the metrics.jsonl contract, fields added by the loop, the console line and summary,
and the TensorBoard / W&B backends read back from their files."""

import gc
import importlib.util
import json
import logging
import math
import re
import struct
import sys
import threading
import types
import warnings

import pytest
import torch

from trainlib.config import ConfigError, load_job_config
from trainlib import metrics as metrics_mod
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


class _FakeWandbRun:
    def __init__(self, **kw):
        self.kw, self.logged, self.summary, self.finished = kw, [], {}, 0

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module: the runs it started, to read back in well under a second."""
    runs = []
    module = types.ModuleType("wandb")
    module.init = lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return runs


@pytest.fixture
def clock(monkeypatch):
    """The logger's perf_counter, read from clock[0]: tests advance time by hand."""
    now = [0.0]
    monkeypatch.setattr(metrics_mod.time, "perf_counter", lambda: now[0])
    return now


def test_wandb_summary_gets_the_end_of_training_numbers_and_a_resumed_job_continues_its_run(
        tmp_path, fake_wandb, clock, monkeypatch):
    cfg = MetricsConfig(enable_wandb=True, wandb_mode="offline", console=False)

    def job(start_step, steps):
        m = MetricsLogger(cfg, tmp_path, rank=0, device=torch.device("cpu"), flops_per_token=1e6, world_size=1,
                          start_step=start_step, tokens_seen=100 * start_step, run_config={"k": 1})
        for step in range(start_step + 1, start_step + steps + 1):
            clock[0] += 2.0
            m.step_done(100)
            m.log(step, loss=1.0, grad_norm=1.0, lr=1.0)
        summary = m.summary(None)
        m.close()
        return summary, fake_wandb[-1]

    summary, first = job(0, 2)
    assert summary == {"tokens": 200, "tokens_seen": 200, "wall_time_s": 4.0, "tokens_per_second": 50.0,
                       "tflops": 50.0 * 1e6 / 1e12, "mfu": None, "last_checkpoint": None}
    assert first.finished == 1 and first.kw["config"] == {"k": 1} and first.kw["mode"] == "offline"
    # W&B's summary: the same numbers under run/, the None ones (no checkpoint, no known peak) left out
    assert first.summary == {f"run/{k}": v for k, v in summary.items() if v is not None}
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment wins over the config
    summary, resumed = job(2, 1)
    assert resumed.kw["id"] == first.kw["id"] and resumed.kw["resume"] == "allow"
    assert resumed.kw["mode"] == "disabled" and resumed.summary["run/tokens_seen"] == 300
    assert job(0, 1)[1].kw["id"] != first.kw["id"]  # a fresh run in the same folder is a new W&B run


def test_a_record_before_any_step_has_zero_throughput_and_a_close_before_the_summary_finishes_wandb_once(
        tmp_path, fake_wandb):
    # e.g. a run that fails early: the guard's event record, then close() from the job's cleanup (twice, say)
    m = MetricsLogger(MetricsConfig(enable_wandb=True, console=False), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1)
    r = m.log(0, loss=1.0, grad_norm=1.0, lr=1.0, event="nonfinite")
    assert (r["tokens_per_second"], r["tflops"], r["tokens_seen"]) == (0.0, 0.0, 0)
    m.close()
    m.close()
    (run,) = fake_wandb
    assert run.finished == 1 and run.summary == {} and [step for step, _ in run.logged] == [0]


def test_tensorboard_shows_each_record_as_it_is_written_and_close_stops_its_writer(tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'trainlib[tensorboard]' (in the dev extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    before = set(threading.enumerate())
    m = MetricsLogger(MetricsConfig(enable_tensorboard=True, console=False), tmp_path, rank=0,
                      device=torch.device("cpu"), flops_per_token=1e6, world_size=1)
    for step in (1, 2, 3):
        m.step_done(10)
        m.log(step, loss=step / 2, grad_norm=1.0, lr=1.0)
    acc = EventAccumulator(str(tmp_path / "tb"))  # while training runs, not only after close
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    m.close()
    assert [t.name for t in set(threading.enumerate()) - before if t.is_alive()] == []


def test_a_run_folder_given_as_a_string_is_created_each_record_is_on_disk_once_logged_and_close_releases_it(
        tmp_path):
    run_dir = tmp_path / "runs" / "a"
    m = MetricsLogger(MetricsConfig(console=False), str(run_dir), rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1)
    m.step_done(1)
    m.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    # before close: a crash from here on loses nothing already logged
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m.close()
        del m
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_on_a_known_gpu_mfu_is_achieved_tflops_over_its_bf16_peak_and_memory_is_the_allocators(
        tmp_path, clock, monkeypatch, capsys):
    # No GPU needed: the two CUDA queries the logger makes are answered here.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    setup_logging(0)
    m = MetricsLogger(MetricsConfig(), tmp_path, rank=0, device=torch.device("cuda", 0), flops_per_token=6e9,
                      world_size=2, float8=True)
    clock[0] += 2.0
    m.step_done(200_000)
    r = m.log(1, loss=1.0, grad_norm=1.0, lr=1.0)
    m.close()
    assert r["tflops"] == 100_000 / 2 * 6e9 / 1e12 == 300.0
    assert r["mfu"] == pytest.approx(300.0 / 989.4, rel=1e-12)  # the table's H100 SXM bf16 peak
    assert r["peak_memory_gib"] == 3.0
    assert (r["mfu_basis"], r["matmul_precision"]) == ("bf16_peak", "float8")
    assert "| mfu 30.3% (float8, vs bf16 peak) | mem   3.00 GiB" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Unlisted 1")
    unknown = MetricsLogger(MetricsConfig(), None, rank=0, device=torch.device("cuda", 0), flops_per_token=6e9,
                            world_size=2)
    unknown.step_done(1)
    assert unknown.log(1, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] is None


def test_log_lines_are_printed_once_even_where_the_root_logger_has_a_handler(capsys):
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    root = logging.getLogger()
    root.addHandler(handler)  # as logging.basicConfig() in the user's program would
    try:
        setup_logging(0)
        logging.getLogger("trainlib").info("hello")
    finally:
        root.removeHandler(handler)
    assert capsys.readouterr().out == "[trainlib] hello\n" and seen == []


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
        tmp_path, clock):
    clock[0] = 100.0
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


def test_eta_is_the_remaining_steps_at_the_wall_clock_rate_since_the_first_log(tmp_path, clock, capsys):
    setup_logging(0)
    m = MetricsLogger(MetricsConfig(log_freq=1), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1, total_steps=101)
    clock[0] += 60.0  # the first step: compile and allocations, kept out of the later rate
    m.step_done(1)
    m.log(1, loss=1.0, grad_norm=1.0, lr=1.0)  # only its own step time: 100 steps x 60 s
    for _ in range(10):
        clock[0] += 3.0
        m.step_done(1)
    with m.untimed():  # validation: out of the step time, in the wall-clock rate
        clock[0] += 30.0
    m.log(11, loss=1.0, grad_norm=1.0, lr=1.0)  # (30 + 30) s over 10 steps: 90 steps x 6 s
    clock[0] += 1.0
    m.step_done(1)
    m.log(101, loss=1.0, grad_norm=1.0, lr=1.0)
    m.close()
    etas = [line.rsplit("| eta ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert etas == ["1:40:00", "0:09:00", "0:00:00"]


@pytest.mark.parametrize("device_name,key", [
    ("NVIDIA H200", "h200"),  # as the H200 machine of 2026-11-26 named itself
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100_pcie"),  # PCIe first: "H100" is in both names
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_of_device_names_the_datasheet_row_mfu_divides_by(device_name, key):
    from trainlib.hardware import GPUS, gpu_of_device

    assert gpu_of_device(device_name) is (GPUS[key] if key else None)


def test_a_resumed_run_drops_the_torn_last_line_a_kill_left_and_says_so(tmp_path, caplog):
    # issue 54 item 6: the resumed run appended its first record to the torn one, a line no reader could
    # parse mid-file, so trainlib.report refused the whole run.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    caplog.set_level("INFO", logger="trainlib")
    m = MetricsLogger(MetricsConfig(console=False), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1, start_step=1)
    m.step_done(1)
    m.log(2, loss=1.5, grad_norm=1.0, lr=1.0)
    m.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert ("metrics.jsonl ended in a torn record (15 bytes, cut mid-write when the last run was stopped): "
            "dropped") in caplog.text
