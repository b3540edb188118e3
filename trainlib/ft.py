"""Start torchft's lighthouse, or a lighthouse and N replica groups on this machine.

    python -m trainlib.ft lighthouse [--bind [::]:29510] [--min-replicas 1] [--heartbeat-timeout-ms 5000]
    python -m trainlib.ft local --groups 2 --nproc-per-group 2 [--max-restarts 3] -- --recipe debug.toml ...

`lighthouse` runs the lighthouse in this process and prints its address (pass
it to every group as --fault_tolerance.lighthouse). `local` starts one, then
one training job per replica group (`trainlib.launch.train_command`: torchrun
for several ranks), each with --fault_tolerance.enable/replica_groups/
replica_id/lighthouse added to the training arguments after `--`; a group
that exits non-zero is started again (up to --max-restarts times) and heals
from a live peer. On a cluster, scripts/slurm_ft.sbatch does the same with one
srun step per group. docs/reliability.md ("Replica groups") explains the
timeouts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from trainlib.launch import train_command

DEFAULT_HEARTBEAT_MS = 5000
DEFAULT_JOIN_MS = 1000


def start_lighthouse(bind: str = "[::]:0", min_replicas: int = 1, heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_MS,
                     join_timeout_ms: int = DEFAULT_JOIN_MS):
    """A lighthouse in this process (torchft's LighthouseServer); `.address()` is what groups connect to.
    heartbeat_timeout_ms: a group silent this long is left out of the next quorum (keep it below the groups'
    fault_tolerance.quorum_timeout_seconds); join_timeout_ms: how long a quorum waits for a group that
    heartbeats but has not asked to join yet (a relaunched one still building its model)."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


def group_args(args: list[str], groups: int, replica_id: int, lighthouse: str) -> list[str]:
    """The training arguments of replica group `replica_id`."""
    return [*args, "--fault_tolerance.enable=true", f"--fault_tolerance.replica_groups={groups}",
            f"--fault_tolerance.replica_id={replica_id}", f"--fault_tolerance.lighthouse={lighthouse}"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainlib.ft", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("lighthouse", "local"):
        s = sub.add_parser(name)
        s.add_argument("--bind", default="[::]:29510" if name == "lighthouse" else "[::]:0",
                       help="address the lighthouse listens on")
        s.add_argument("--min-replicas", type=int, default=1, help="fewest groups a quorum forms with")
        s.add_argument("--heartbeat-timeout-ms", type=int, default=DEFAULT_HEARTBEAT_MS,
                       help="a group silent this long is dropped at the next quorum")
        s.add_argument("--join-timeout-ms", type=int, default=DEFAULT_JOIN_MS,
                       help="how long a quorum waits for a heartbeating group that has not joined yet")
    local = sub.choices["local"]
    local.add_argument("--groups", type=int, default=2, help="replica groups (fault_tolerance.replica_groups)")
    local.add_argument("--nproc-per-group", type=int, default=1, help="ranks of each group (its own torchrun)")
    local.add_argument("--max-restarts", type=int, default=3, help="times a failed group is started again")
    local.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then trainlib.train's arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    lighthouse = start_lighthouse(ns.bind, ns.min_replicas, ns.heartbeat_timeout_ms, ns.join_timeout_ms)
    print(f"trainlib.ft: lighthouse at {lighthouse.address()}", flush=True)
    try:
        if ns.command == "lighthouse":
            while True:
                time.sleep(3600)
        args = ns.train_args[1:] if ns.train_args[:1] == ["--"] else ns.train_args
        cmds = [train_command(ns.nproc_per_group, group_args(args, ns.groups, g, lighthouse.address()))
                for g in range(ns.groups)]
        procs = {g: subprocess.Popen(cmd) for g, cmd in enumerate(cmds)}
        restarts, codes = 0, {}
        while procs:
            time.sleep(0.5)
            for g, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                del procs[g]
                if code != 0 and restarts < ns.max_restarts and procs:  # live peers to heal from
                    restarts += 1
                    print(f"trainlib.ft: replica group {g} exited {code}; starting it again "
                          f"({restarts}/{ns.max_restarts})", flush=True)
                    procs[g] = subprocess.Popen(cmds[g])
                else:
                    codes[g] = code
        return max(codes.values(), default=0)
    except KeyboardInterrupt:
        return 130
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    sys.exit(main())
