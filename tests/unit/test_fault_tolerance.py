"""[fault_tolerance]: its refusals (one line each), the replica groups' data slices, the SLURM script's groups.
The multi-process runs are tests/e2e/test_fault_tolerance.py."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, RECIPES, run_cli
from trainlib.config import ConfigError, load_job_config
from trainlib.config.validate import resolve_local_batch_size, validate_job
from trainlib.models.registry import resolve_model
from trainlib.parallel import ParallelDims

FT = ["--fault_tolerance.enable=true", "--fault_tolerance.replica_groups=2", "--fault_tolerance.lighthouse=http://x:1"]


def _cfg(*overrides):
    return load_job_config(str(RECIPES / "debug.toml"), list(overrides))


def test_off_by_default_and_checks_nothing():
    cfg = _cfg("--fault_tolerance.replica_id=7")  # ignored while off
    assert not cfg.fault_tolerance.enable
    assert ParallelDims.from_config(cfg.parallelism, 2, cfg.fault_tolerance).replica_groups == 1


@pytest.mark.parametrize("overrides, words", [
    (["--fault_tolerance.enable=true"], ["needs a replica dimension", "replica_groups = 1", "replica_groups >= 2"]),
    ([*FT, "--fault_tolerance.replica_id=2"], ["replica_id = 2 is outside the 2 replica groups", "0 .. 1"]),
    ([*FT, "--fault_tolerance.min_replica_size=3"], ["min_replica_size (3) exceeds replica_groups (2)"]),
    ([*FT, "--fault_tolerance.quorum_timeout_seconds=5"], ["connect (10.0) <= process_group (10.0) < quorum (5.0)"]),
])
def test_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def _validate(cfg):
    dims = ParallelDims.from_config(cfg.parallelism, 1, cfg.fault_tolerance)
    validate_job(cfg, dims, resolve_model(cfg.model), 256)


def test_refused_without_torchft(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"needs torchft, which is not installed; pip install 'trainlib\[ft\]'"):
        _validate(_cfg(*FT))


@pytest.mark.parametrize("overrides, words", [
    (["--watchdog.min_seconds=20"], ["quorum_timeout_seconds + process_group_timeout_seconds (25) must be below "
                                     "watchdog.min_seconds (20)"]),
    (["--training.on_nonfinite=rollback", "--checkpoint.enable=true"], ["'rollback' is not supported"]),
    (["--validation.enable=true"], ["validation.enable is not supported with fault_tolerance.enable"]),
])
def test_cross_section_rules(overrides, words):
    pytest.importorskip("torchft")
    with pytest.raises(ConfigError) as e:
        _validate(_cfg(*FT, *overrides))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_each_group_reads_its_own_slices():
    """Group g of R takes data-parallel slices g*dp .. g*dp + dp - 1 of R*dp; the local batch divides the
    global batch over every group's ranks."""
    cfg = _cfg(*FT, "--fault_tolerance.replica_id=1", "--training.global_batch_size=8")
    dims = ParallelDims.from_config(cfg.parallelism, 2, cfg.fault_tolerance)
    assert (dims.dp, dims.data_parallel, dims.replica_id) == (2, 4, 1)
    assert resolve_local_batch_size(cfg, dims) == (2, 1)
    assert ParallelDims(world_size=1, replica_groups=2, replica_id=1).dp_coords() == (1, 2)  # before the mesh
    cfg = _cfg(*FT, "--training.global_batch_size=6")
    with pytest.raises(ConfigError, match=r"x replica groups \(2\) \(4\)"):
        resolve_local_batch_size(cfg, ParallelDims.from_config(cfg.parallelism, 2, cfg.fault_tolerance))


def test_unreachable_lighthouse_is_refused_naming_it(tmp_path):
    """Through the real CLI: after fault_tolerance.connect_timeout_seconds, one line naming the address."""
    pytest.importorskip("torchft")
    proc = run_cli(["--recipe", str(RECIPES / "debug.toml"), f"--job.dump_folder={tmp_path}", *FT[:2],
                    "--fault_tolerance.lighthouse=http://127.0.0.1:9", "--fault_tolerance.connect_timeout_seconds=1",
                    "--fault_tolerance.process_group_timeout_seconds=2", "--fault_tolerance.quorum_timeout_seconds=3"],
                   timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "lighthouse" in x and "INFO" not in x]
    assert "no torchft lighthouse answers at http://127.0.0.1:9 after fault_tolerance.connect_timeout_seconds = 1" \
        in line and "python -m trainlib.ft lighthouse" in line


# A group waits for the lighthouse, as real ones do (they retry its address until the connect timeout): without
# it a loaded machine could finish both fake groups, and the script kill the lighthouse, before it had logged.
FAKE_SRUN = """#!/usr/bin/env bash
for _ in $(seq 300); do grep -q '^python' "$LOG" 2>/dev/null && break; sleep 0.1; done
echo "srun $* NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR RDZV_ID=$RDZV_ID" >> "$LOG"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
for h in n1 n2 n3 n4; do echo $h; done
"""
FAKE_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$LOG"; exec sleep 30
"""


def test_slurm_script_starts_a_lighthouse_and_one_srun_per_group(tmp_path):
    """scripts/slurm_ft.sbatch on 4 nodes, 2 groups (srun, scontrol and python faked): the lighthouse on the
    first node, each group on its own 2 nodes with its replica id, rendezvous host and id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("python", FAKE_PYTHON)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", LOG=str(log), SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="4",
               SLURM_JOB_NODELIST="n[1-4]", SLURM_SUBMIT_DIR=str(REPO), REPLICA_GROUPS="2")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_ft.sbatch"), "--recipe", "r.toml"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(log.read_text().splitlines())
    assert lines[0].startswith("python -m trainlib.ft lighthouse --bind [::]:29510")
    for g, host in ((0, "n1"), (1, "n3")):
        (line,) = [x for x in lines if f"--fault_tolerance.replica_id={g} " in x]
        assert f"--nodes=2 --ntasks=2 --relative={2 * g} " in line and "--recipe r.toml" in line
        assert "--fault_tolerance.lighthouse=http://n1:29510" in line and "--fault_tolerance.replica_groups=2" in line
        assert line.endswith(f"NNODES=2 MASTER_ADDR={host} RDZV_ID=7-group{g}")


def test_report_draws_live_groups_and_lists_heals(tmp_path):
    """trainlib.report on two replica groups' run folders: a panel of ft_participants with each heal marked,
    and the table's heal events (step: seconds) and fewest live groups."""
    import json

    from trainlib.report import report, training_panels, load_run

    live = {0: [2, 2, 1, 1, 2, 2], 1: [2, 2, None, None, 2, 2]}
    for g in (0, 1):
        run = tmp_path / f"replica_{g}"
        run.mkdir()
        rows = [{"step": s, "loss": 5.0 - 0.1 * s, "ft_participants": n, "ft_quorum_ms": 1.0,
                 "ft_heal_s": 0.35 if (g, s) == (1, 5) else 0.0} for s, n in enumerate(live[g], 1) if n]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [load_run(tmp_path / f"replica_{g}") for g in (0, 1)]
    (panel,) = [p for p in training_panels(runs)[0] if "replica groups" in p.title]
    heals = [s for s in panel.series if s.markers]
    assert [(s.label, s.steps, s.values) for s in heals] == [("replica_1 heals", [5], [2])]
    page = report([tmp_path / "replica_0", tmp_path / "replica_1"], tmp_path / "r")[0].read_text()
    assert "heals (step: seconds)" in page and "<td>5: 0.35 s</td>" in page and "<td>none</td>" in page
    assert "<td>1</td>" in page  # group 0 trained alone
