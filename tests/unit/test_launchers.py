"""scripts/k8s/trainlib-job.yaml holds together: the parts that must agree do.

It cannot run here (no cluster); the launcher it calls, scripts/launch.sh, is
run for real in tests/e2e/test_launchers.py."""

import sys

import pytest
import yaml  # the dev extra

from tests.helpers import REPO
from trainlib.config import load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.launch import train_command


def test_k8s_job_is_consistent_and_its_command_is_a_valid_job():
    docs = {d["kind"]: d for d in yaml.safe_load_all((REPO / "scripts" / "k8s" / "trainlib-job.yaml").read_text())}
    service, job = docs["Service"], docs["Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}

    # One pod per node, all at once; pod 0 reachable by name through the headless Service.
    assert job["spec"]["completionMode"] == "Indexed"
    assert int(env["NNODES"]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert [int(env["MASTER_PORT"])] == [p["port"] for p in service["spec"]["ports"]]
    assert int(env["NPROC_PER_NODE"]) == container["resources"]["limits"]["nvidia.com/gpu"]

    # The command is the launcher with a recipe and overrides that load.
    bash, launcher, *args = container["command"]
    assert (bash, launcher) == ("bash", "scripts/launch.sh") and (REPO / launcher).is_file()
    ns, overrides = RecipeArgumentParser("launch.sh").parse_recipe_args(args)
    cfg = load_job_config(REPO / ns.recipe, overrides)
    # Every pod writes checkpoints to the same folder: it must be on the shared volume.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert "persistentVolumeClaim" in next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert cfg.job.dump_folder.startswith(mounts["checkpoints"] + "/")


def test_train_command_is_a_plain_process_for_one_rank_and_torchrun_for_more():
    assert train_command(1, ["--x=1"]) == [sys.executable, "-m", "trainlib.train", "--x=1"]
    assert train_command(4) == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                                "-m", "trainlib.train"]
    with pytest.raises(ValueError, match="nproc must be >= 1, got 0"):
        train_command(0)
