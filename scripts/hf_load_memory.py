"""Memory and time that loading a Hugging Face folder into a model adds to one process.

    python scripts/hf_load_memory.py --folder /tmp/hf_mem        # writes the folder first if it is missing

Builds a Llama of the given shape (default: dim 2048, 8 blocks, 16 heads, 4 kv
heads, ffn 5632, vocab 32000: 492M parameters), writes it once as a bf16 HF
folder, then materialises an fp32 model and loads the folder into it as
`checkpoint.initial_load_path` does (`load_hf_into_model`), sampling the
process's anonymous resident memory every 2 ms. Reported: the peak growth over
the memory before the load (the files themselves are memory-mapped: page cache,
shared by a node's ranks, not counted here), and the load's wall time.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trainlib

from trainlib.checkpoint.hf import load_hf_into_model, write_hf_folder
from trainlib.models.llama3 import Transformer, get_model_args


def anon_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True, help="the HF folder (written when it does not exist)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=5632)
    p.add_argument("--vocab-size", type=int, default=32000)
    a = p.parse_args()
    args = get_model_args("debug", dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                          ffn_dim=a.ffn_dim, vocab_size=a.vocab_size)
    if not (Path(a.folder) / "config.json").is_file():
        src = Transformer(args, rope_len=8)
        src.init_weights(seed=0)
        write_hf_folder({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}, args, a.folder)
        del src
    model = Transformer(args, rope_len=8)
    model.init_buffers()
    n = sum(p.numel() for p in model.parameters())
    before, peak, done = anon_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anon_mib())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    load_hf_into_model([model], a.folder, args)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    wq = args.dim * args.dim * 2 / 2**20
    print(f"{n / 1e6:.0f}M parameters (fp32 model {n * 4 / 2**20:.0f} MiB, bf16 files {n * 2 / 2**20:.0f} MiB): "
          f"the load adds {max(peak[0] - before, 0):.0f} MiB of anonymous memory at its peak (one block's bf16 wq: "
          f"{wq:.0f} MiB), {seconds:.1f} s")


if __name__ == "__main__":
    main()
