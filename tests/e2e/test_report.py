"""`python -m trainlib.report` on two real runs of the debug recipe."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, run_cli


@pytest.mark.slow  # two training runs and a figure (10 s); CI's slow suite runs it
def test_report_overlays_two_real_runs(tmp_path):
    image = pytest.importorskip("matplotlib.image", reason="the PNG needs matplotlib: pip install -e '.[dev]'")

    runs = {"lr3e-3": "3e-3", "lr1e-3": "1e-3"}
    for name, lr in runs.items():
        proc = run_cli(["--recipe", "debug", "--training.steps=4", "--training.seq_len=64", "--metrics.log_freq=1",
                        f"--optimizer.lr={lr}", f"--job.dump_folder={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "trainlib.report", *(str(tmp_path / n) for n in runs),
                          "--out", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-2000:]

    page = (tmp_path / "cmp.html").read_text()
    for name in runs:
        last = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert f"{name} (optimizer.lr=" in page and f"<td>{last['loss']:.4g}</td>" in page
    png = image.imread(tmp_path / "cmp.png")
    assert png.shape[:2] == (900, 1600) and (png[..., :3] < 0.9).any(axis=-1).mean() > 0.01
