"""The parity tool itself: layouts parsed into CLI arguments, and the comparison
every layout test relies on (a comparison that always said 0 would pass them all)."""

import math

from trainlib import parity
from trainlib.parity import LayoutRun, parse_layout, run_parity


def test_parse_layout():
    nproc, args = parse_layout("dp_replicate=2,dp_shard=2,training.local_batch_size=1")
    assert nproc == 4
    assert "--training.local_batch_size=1" in args and "--parallelism.dp_shard=2" in args
    assert "--parallelism.tp=1" in args


def _run_layouts_as(curves: dict, monkeypatch) -> None:
    """Each layout's run gives `curves[layout]` (losses, grad norms), as its metrics.jsonl would; nothing runs."""
    monkeypatch.setattr(parity, "run_layout",
                        lambda recipe, spec, *a, **k: LayoutRun(spec or "single", 2, *curves[spec]))


def test_each_layout_is_compared_step_by_step_with_the_baseline(monkeypatch, tmp_path):
    curves = {  # layout -> (losses, grad norms)
        "": ([4.0, 2.0, 1.0], [10.0, 5.0, 2.0]),
        "dp_shard=2": ([4.0, 2.0, 1.0], [10.0, 5.0, 2.0]),
        "tp=2": ([4.0, 2.02, 1.0], [10.0, 5.0, 2.5]),  # 1% off in loss at step 2, 25% in grad norm at step 3
        "pp=2": ([4.0, 2.0], [10.0, 5.0]),  # a run that stopped early
        "cp=2": ([4.0, float("nan"), 1.0], [10.0, 5.0, 2.0]),
    }
    _run_layouts_as(curves, monkeypatch)
    report = run_parity(None, ["dp_shard=2", "tp=2", "pp=2", "cp=2"], steps=3, out_dir=tmp_path)
    got = {r.name: (r.max_rel_loss, r.max_rel_grad_norm) for r in report.runs}
    assert got["dp_shard=2"] == (0.0, 0.0)
    assert math.isclose(got["tp=2"][0], 0.01) and math.isclose(got["tp=2"][1], 0.25)
    assert got["pp=2"] == (math.inf, math.inf)
    assert got["cp=2"] == (math.inf, 0.0)
    assert report.max_rel_loss == report.max_rel_grad_norm == math.inf


def test_cli_fails_a_layout_past_the_tolerance(monkeypatch, capsys):
    _run_layouts_as({"": ([4.0, 2.0], [1.0, 1.0]), "tp=2": ([4.0, 2.0002], [1.0, 1.0])}, monkeypatch)  # 1e-4 off
    assert parity.main(["--layouts", "tp=2", "--steps", "2"]) == 1
    assert "FAIL: max relative loss deviation 1.00e-04 (tolerance 1e-05)" in capsys.readouterr().out
    assert parity.main(["--layouts", "tp=2", "--steps", "2", "--tol", "1e-3"]) == 0
    assert "PASS: max relative loss deviation 1.00e-04 (tolerance 1e-03)" in capsys.readouterr().out
