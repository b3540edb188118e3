"""The multi-node launch path, as two torchrun agents on localhost forming one job."""

import json
import os
import socket
import subprocess

from tests.helpers import RECIPES, REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_form_one_job(tmp_path):
    env = dict(os.environ, NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RDZV_ID="test-two-nodes", PYTHONPATH=str(REPO))
    args = ["bash", str(REPO / "scripts" / "launch.sh"), "--recipe", str(RECIPES / "debug.toml"),
            "--training.steps=4", "--metrics.log_freq=1", f"--job.dump_folder={tmp_path}"]
    nodes = [subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert any("world 2 on cpu" in o and "dp_shard=2" in o for o in outs)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_multi_node_needs_master_addr():
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    env.update(NNODES="2", NPROC_PER_NODE="1")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "launch.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs MASTER_ADDR" in proc.stderr


