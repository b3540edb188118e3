"""A real, non-editable `pip install` ships the recipes: the design card's command
works as typed from a folder that is not the repository."""

import os
import shutil
import subprocess
import sys

from tests.helpers import RECIPES, REPO, run_tree


def test_non_editable_install_runs_recipes_by_name_from_any_folder(tmp_path):
    src, site, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("trainlib", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    assert sorted(p.name for p in (site / "trainlib" / "recipes").iterdir()) == sorted(
        p.name for p in RECIPES.glob("*.toml"))
    # The `trainlib` command (python -m trainlib.launch: checks the recipe, then torchrun) is installed.
    assert "trainlib.launch" in (site / "bin" / "trainlib").read_text()

    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    # The 70B recipe by its card name; its `extends = "llama3_base.toml"` resolves beside it, in the install.
    probe = ("import trainlib; from trainlib.config import load_job_config, resolve_recipe; "
             "c = load_job_config('llama70b.toml'); "
             "print(trainlib.__file__, resolve_recipe('llama70b.toml'), c.model.flavor, c.training.seq_len)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    assert out == [str(site / "trainlib" / "__init__.py"), str(site / "trainlib" / "recipes" / "llama3_70b.toml"),
                   "llama3.1_70b", "8192"]
    # And a run through torchrun, as typed, with the recipe named rather than pathed.
    run = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                    "-m", "trainlib.train", "--recipe", "debug.toml", "--training.steps=2",
                    f"--job.dump_folder={tmp_path / 'run'}"], 300, cwd=elsewhere, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
    bad = subprocess.run([str(site / "bin" / "trainlib"), "--nproc-per-node=2", "--recipe", "debug", "--trainig.steps=2"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "unknown section 'trainig'" in bad.stderr

    # The planner's calibration rows ship in the package (before: only in the checkout's benchmarks/, so an
    # installed trainlib had none), and the installed planner plans as the checkout's does.
    from trainlib.plan.calibration import ROWS

    probe = "from trainlib.plan.calibration import ROWS, ROWS_FILE; print(len(ROWS), ROWS_FILE)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, check=True, capture_output=True,
                         text=True, timeout=120).stdout.split()
    assert out == [str(len(ROWS)), str(site / "trainlib" / "plan" / "calibration.toml")] and ROWS
    plan = [sys.executable, "-m", "trainlib.plan", "--recipe", "llama3_8b", "--world-size", "8", "--json"]
    installed = subprocess.run(plan, cwd=elsewhere, env=env, check=True, capture_output=True, text=True, timeout=300)
    checkout = subprocess.run(plan, cwd=REPO, env=dict(env, PYTHONPATH=str(REPO)), check=True, capture_output=True,
                              text=True, timeout=300)
    assert installed.stdout == checkout.stdout
