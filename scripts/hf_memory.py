"""Memory and time that a Hugging Face import or export adds to one process.

    python scripts/hf_memory.py import --folder /tmp/hf_mem    # writes the HF folder first if it is missing
    python scripts/hf_memory.py export --folder /tmp/dcp_mem   # writes an fp32 DCP checkpoint first if missing
    python scripts/hf_memory.py hf-to-dcp --folder /tmp/hf_mem # the same HF folder as import

Builds a Llama of the given shape (default: dim 2048, 8 blocks, 16 heads, 4 kv
heads, ffn 5632, vocab 32000: 492M parameters). `import` writes it once as a
bf16 HF folder, then materialises an fp32 model and loads the folder into it as
`checkpoint.initial_load_path` does (`load_hf_into_model`). `export` writes it
once as an fp32 DCP checkpoint (as training saves it), then converts that to an
HF folder as `checkpoint.export_hf` and `trainlib.convert dcp-to-hf` do
(`dcp_to_hf`), in files of at most `--shard-mb` (the default 5 GB of a real
export would hold this whole model in one file). `hf-to-dcp` converts the
`import` folder to a DCP checkpoint as `trainlib.convert hf-to-dcp` does
(`hf_to_dcp`). Each samples the process's
anonymous resident memory every 2 ms and reports the peak growth over the
memory before the operation (files read through memory maps are page cache,
shared by a node's ranks, not counted) and its wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.checkpoint.convert import dcp_to_hf, hf_to_dcp
from trainlib.checkpoint.hf import load_hf_into_model, write_hf_folder
from trainlib.models.llama3 import Transformer, get_model_args


def anon_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) / 1024


def peak_anon_growth(fn) -> tuple[float, float]:
    """(peak growth of anonymous memory in MiB while `fn()` runs, its seconds)."""
    before, peak, done = anon_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return max(peak[0] - before, 0.0), seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["import", "export", "hf-to-dcp"])
    p.add_argument("--folder", required=True, help="the HF folder or DCP checkpoint read (written when missing)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--shard-mb", type=float, default=256, help="export: the most one HF file holds, in MiB")
    a = p.parse_args()
    args = get_model_args("debug", dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                          ffn_dim=a.ffn_dim, vocab_size=a.vocab_size)
    folder = Path(a.folder)
    if not folder.is_dir():
        src = Transformer(args, rope_len=8)
        src.init_weights(seed=0)
        if a.what in ("import", "hf-to-dcp"):
            write_hf_folder({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, args, folder)
        else:
            import torch.distributed.checkpoint as dcp

            from trainlib.checkpoint.state import TrainState

            dcp.save({"model": src.state_dict(), "trainer": TrainState(model_args=args)}, checkpoint_id=str(folder),
                     no_dist=True)
        del src
    n = sum(p.numel() for p in Transformer(args, rope_len=8).parameters())
    if a.what == "import":
        model = Transformer(args, rope_len=8)
        model.init_buffers()
        grew, seconds = peak_anon_growth(lambda: load_hf_into_model([model], folder, args))
        what = "the import (bf16 files, fp32 model)"
    elif a.what == "hf-to-dcp":
        with tempfile.TemporaryDirectory() as out:
            grew, seconds = peak_anon_growth(lambda: hf_to_dcp(folder, Path(out) / "dcp"))
        what = "the conversion to DCP (bf16 files)"
    else:
        with tempfile.TemporaryDirectory() as out:
            grew, seconds = peak_anon_growth(lambda: dcp_to_hf(folder, out, max_shard_bytes=int(a.shard_mb * 2**20)))
            files = len(list(Path(out).glob("*.safetensors")))
        what = f"the export (fp32 checkpoint, {files} fp32 files of <= {a.shard_mb:g} MiB)"
    print(f"{n / 1e6:.0f}M parameters ({n * 4 / 2**20:.0f} MiB in fp32): {what} adds {grew:.0f} MiB of anonymous "
          f"memory at its peak, {seconds:.1f} s")


if __name__ == "__main__":
    main()
