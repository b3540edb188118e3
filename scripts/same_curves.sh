#!/bin/bash
# Do two commits train the debug recipe to the same curves, bit for bit? Runs 20 steps of recipes/debug.toml
# under five layouts (one process fp32 and bf16 autocast, FSDP2, TP2, PP2) at OLD (a worktree) and at the
# current tree, and compares every step's loss and grad norm with ==.
#   bash scripts/same_curves.sh OLD_COMMIT            (~10 min on 2 cores)
set -euo pipefail
old=${1:?usage: bash scripts/same_curves.sh OLD_COMMIT}
cd "$(dirname "$0")/.."
here=$PWD
work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q "$work/old" "$old"
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
py=${PYTHON:-python}
run() {  # tree tag nproc args...
    local tree=$1 tag=$2 n=$3; shift 3
    local out="$work/$tag-$(basename "$tree")" launch=("$py" -m trainlib.train)
    [ "$n" -gt 1 ] && launch=("$py" -m torch.distributed.run --standalone --nproc-per-node="$n" -m trainlib.train)
    (cd "$tree" && PYTHONPATH="$tree" "${launch[@]}" --recipe "$tree/recipes/debug.toml" --training.steps=20 \
        --metrics.log_freq=1 --metrics.console=false --job.dump_folder="$out" "$@" >"$out.log" 2>&1)
}
for tree in "$work/old" "$here"; do
    run "$tree" single 1
    run "$tree" bf16 1 --training.mixed_precision_param=bfloat16
    run "$tree" fsdp2 2 --parallelism.dp_shard=2
    run "$tree" tp2 2 --parallelism.dp_shard=1 --parallelism.tp=2
    run "$tree" pp2 2 --parallelism.dp_shard=1 --parallelism.pp=2
done
"$py" - "$work" "$(basename "$here")" <<'PY'
import json, sys
work, here = sys.argv[1:]
same = True
for tag in ("single", "bf16", "fsdp2", "tp2", "pp2"):
    def curve(tree):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"{work}/{tag}-{tree}/metrics.jsonl"))
                if r.get("loss") is not None and "event" not in r]
    a, b = curve("old"), curve(here)
    ok = a == b and len(a) == 20
    same &= ok
    print(f"{tag:<7} {'bitwise the same' if ok else 'DIFFERENT'} ({len(b)} steps)")
sys.exit(0 if same else 1)
PY
