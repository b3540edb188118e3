"""MetricsLogger: the metrics.jsonl contract and fields added by the loop."""

import json

import pytest
import torch

from trainlib.metrics import MetricsConfig, MetricsLogger, setup_logging

CONTRACT = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "step_time_s", "tflops", "mfu", "peak_memory_gib")


def test_added_fields_are_recorded_and_printed_and_cannot_shadow_the_contract(tmp_path, capsys):
    setup_logging(0)
    m = MetricsLogger(MetricsConfig(log_freq=1), tmp_path, rank=0, device=torch.device("cpu"),
                      flops_per_token=1e6, world_size=1)
    m.step_done(1024)
    m.log(1, loss=2.0, grad_norm=0.5, lr=1e-3, val_loss=2.25)
    with pytest.raises(TypeError, match=r"\['step_time_s'\] are built-in fields"):
        m.log(2, loss=2.0, grad_norm=0.5, lr=1e-3, step_time_s=1.0)
    m.close()
    (record,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(CONTRACT) <= set(record) and record["val_loss"] == 2.25 and record["loss"] == 2.0
    line = capsys.readouterr().out.strip()
    assert line.startswith("[trainlib] step      1 | loss   2.0000") and line.endswith("| val_loss 2.25")


def test_non_finite_values_stay_valid_json_and_records_at_one_point_share_the_window(tmp_path):
    m = MetricsLogger(MetricsConfig(log_freq=1, console=False), tmp_path, rank=0, device=torch.device("cpu"),
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
