"""Step-time jitter with Python's automatic garbage collection against trainlib's schedule
(training.gc_freq: automatic collection off, one full collection every N steps).

    python scripts/gc_jitter.py --steps 200 --gc-freq 50 --rounds 2 [--recipe R] [--section.key=value ...]

Trains in this process (the debug model by default), alternating gc_freq = 0 (automatic)
and --gc-freq, `--rounds` times each, every step logged; prints per run the step time
(median, standard deviation, 99th percentile, max; the first step left out) and the
collections that ran between the end of step 1 and the end of the last step, with their
pauses (from gc.callbacks); and the pause of the last full collection before step 1 (with
gc_freq, the one over the whole heap that setup runs before freezing it).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.config import load_job_config
from trainlib.config.cli import RecipeArgumentParser
from trainlib.train import train


def run(recipe: str | None, overrides: list[str], steps: int, gc_freq: int, folder: Path) -> dict:
    collections, started = [], {}  # (generation, end time, pause)

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = time.time()
        else:
            collections.append((info["generation"], time.time(), time.time() - started[info["generation"]]))

    cfg = load_job_config(recipe, [*overrides, f"--training.steps={steps}", f"--training.gc_freq={gc_freq}",
                                   "--metrics.log_freq=1", "--metrics.console=false", f"--job.dump_folder={folder}"])
    gc.callbacks.append(watch)
    try:
        train(cfg)
    finally:
        gc.callbacks.remove(watch)
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time_s"] * 1e3 for r in records[1:])
    before = [pause for g, end, pause in collections if g == 2 and end < records[0]["time"]]
    loop = [(g, pause) for g, end, pause in collections if records[0]["time"] < end < records[-1]["time"]]
    return {"gc_freq": gc_freq, "median": statistics.median(times), "std": statistics.pstdev(times),
            "p99": times[max(0, round(0.99 * len(times)) - 1)], "max": times[-1],
            "setup": 1e3 * before[-1] if before else None,
            "collections": {g: (sum(1 for x, _ in loop if x == g), 1e3 * max((p for x, p in loop if x == g), default=0))
                            for g in (0, 1, 2)}}


def main(argv: list[str] | None = None) -> int:
    parser = RecipeArgumentParser("python scripts/gc_jitter.py", __doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--gc-freq", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    ns, overrides = parser.parse_recipe_args(sys.argv[1:] if argv is None else argv)
    print(f"{'gc_freq':>7} {'median ms':>9} {'std ms':>7} {'p99 ms':>7} {'max ms':>7}   "
          "collections during the run per generation (count, longest pause ms); last full collection before it")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(ns.rounds):
            for gc_freq in (0, ns.gc_freq):
                r = run(ns.recipe, overrides, ns.steps, gc_freq, Path(tmp) / f"{gc_freq}-{i}")
                gens = "  ".join(f"gen{g} {n:>4} {p:6.1f}" for g, (n, p) in r["collections"].items())
                print(f"{r['gc_freq']:>7} {r['median']:>9.1f} {r['std']:>7.1f} {r['p99']:>7.1f} {r['max']:>7.1f}   "
                      f"{gens}   " + (f"{r['setup']:.1f} ms" if r["setup"] is not None else "none"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
