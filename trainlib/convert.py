"""Convert checkpoints between Hugging Face safetensors and trainlib's DCP format.

    python -m trainlib.convert hf-to-dcp HF_DIR OUT_DIR
    python -m trainlib.convert dcp-to-hf CHECKPOINT_DIR OUT_DIR [--flavor F] [--dtype bfloat16]

hf-to-dcp reads config.json and every *.safetensors file (sharded or not) and
writes a DCP checkpoint holding the model (start training from it with
`checkpoint.initial_load_path=OUT_DIR`). dcp-to-hf reads a (possibly sharded)
trainlib checkpoint in this one process, without GPUs or a process group, and
writes one consolidated `model.safetensors` and a `config.json` that
`transformers.LlamaForCausalLM.from_pretrained` loads. The model shape comes
from the checkpoint itself, else from `--flavor`, else from the run's saved
config.toml two folders up.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainlib.checkpoint.hf import args_from_dict, read_hf_folder, write_hf_folder
from trainlib.models.llama3.model import ModelArgs, get_model_args

__all__ = ["hf_to_dcp", "dcp_to_hf", "read_dcp_model"]


def hf_to_dcp(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> ModelArgs:
    args, sd = read_hf_folder(hf_dir)
    state = {"model": sd, "trainer": {"step": 0, "tokens_seen": 0, "model_args": asdict(args)}}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(out_dir), no_dist=True)
    return args


def read_dcp_model(ckpt_dir: str | os.PathLike) -> tuple[dict | None, dict[str, torch.Tensor]]:
    """(saved model shape or None, full model tensors by trainlib name), read in
    this process from however many shards the checkpoint has."""
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / ".metadata").is_file():
        raise ValueError(f"{ckpt_dir} is not a complete DCP checkpoint (no .metadata): pass a step-N folder")
    meta = FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    sd: dict = {}
    for key, m in meta.items():
        if key.startswith("model.") and isinstance(m, TensorStorageMetadata):
            sd[key] = torch.empty(m.size, dtype=m.properties.dtype)
        elif key.startswith("trainer.model_args."):
            sd[key] = None
    if not any(k.startswith("model.") for k in sd):
        raise ValueError(f"{ckpt_dir} holds no model tensors (keys model.*): not a trainlib checkpoint")
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    prefix = "trainer.model_args."
    args = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)} or None
    return args, {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}


def _args_from_run_config(ckpt_dir: Path) -> ModelArgs | None:
    cfg_path = ckpt_dir.resolve().parent.parent / "config.toml"
    if not cfg_path.is_file():
        return None
    from trainlib.config import load_job_config
    from trainlib.models.registry import model_args

    return model_args(load_job_config(str(cfg_path)).model)


def dcp_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, flavor: str | None = None,
              dtype: str | None = None) -> Path:
    saved, sd = read_dcp_model(ckpt_dir)
    if flavor is not None:
        args = get_model_args(flavor)
    elif saved:
        args = args_from_dict(saved)
    else:
        args = _args_from_run_config(Path(ckpt_dir))
        if args is None:
            raise ValueError(f"{ckpt_dir} does not record the model shape and no run config.toml is two folders "
                             "up: pass --flavor")
    if dtype is not None:
        sd = {k: v.to(getattr(torch, dtype)) for k, v in sd.items()}
    return write_hf_folder(sd, args, out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainlib.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-dcp", help="HF safetensors folder -> DCP checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    b = sub.add_parser("dcp-to-hf", help="DCP checkpoint (a step-N folder) -> HF safetensors + config.json")
    b.add_argument("checkpoint_dir")
    b.add_argument("out_dir")
    b.add_argument("--flavor", default=None, help="model flavor, when the checkpoint does not record its shape")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="cast on export")
    ns = p.parse_args(argv)
    try:
        if ns.cmd == "hf-to-dcp":
            args = hf_to_dcp(ns.hf_dir, ns.out_dir)
            print(f"wrote DCP checkpoint {ns.out_dir} (dim={args.dim}, n_layers={args.n_layers})")
        else:
            out = dcp_to_hf(ns.checkpoint_dir, ns.out_dir, ns.flavor, ns.dtype)
            print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'}")
    except (ValueError, FileNotFoundError) as e:
        print(f"trainlib.convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
