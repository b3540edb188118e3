"""Convert checkpoints between Hugging Face safetensors and trainlib's DCP format.

    python -m trainlib.convert hf-to-dcp HF_DIR OUT_DIR
    python -m trainlib.convert dcp-to-hf CHECKPOINT_DIR OUT_DIR [--model NAME] [--flavor F] [--dtype bfloat16]
        [--max-shard-gb 5]

hf-to-dcp reads config.json (its `architectures` pick the family) and every
*.safetensors file (sharded or not) and writes a DCP checkpoint holding the
model and its family and shape (start training from it with
`checkpoint.initial_load_path=OUT_DIR`). dcp-to-hf reads a (possibly sharded)
trainlib checkpoint in this one process, without GPUs or a process group, and
writes `config.json` and the weights in safetensors files of at most
`--max-shard-gb` (one `model.safetensors`, or numbered files and their index,
as transformers writes them), reading one file's worth of weights at a time;
the family's transformers class loads the folder with `from_pretrained`. The
family and shape come from the checkpoint itself (it records them), else from
`--model` and `--flavor`, else from the run's saved config.toml two folders
up. The conversions live in `trainlib.checkpoint.convert`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from trainlib.checkpoint.convert import dcp_to_hf, hf_to_dcp, saved_model_args
from trainlib.checkpoint.hf import HF_SHARD_BYTES, check_model_args, spec_of_args
from trainlib.errors import ConfigError, writable_folder
from trainlib.models.registry import MODELS, get_model_spec


def _args_from_run_config(ckpt_dir: Path):
    cfg_path = ckpt_dir.resolve().parent.parent / "config.toml"
    if not cfg_path.is_file():
        return None
    from trainlib.config import job_model_args, load_job_config

    return job_model_args(load_job_config(str(cfg_path)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainlib.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-to-dcp", help="HF safetensors folder -> DCP checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    b = sub.add_parser("dcp-to-hf", help="DCP checkpoint (a step-N folder) -> HF safetensors + config.json")
    b.add_argument("checkpoint_dir")
    b.add_argument("out_dir")
    b.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="model family (model.name), when the checkpoint does not record it")
    b.add_argument("--flavor", default=None, help="model flavor, when the checkpoint does not record its shape")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="cast on export")
    b.add_argument("--max-shard-gb", type=float, default=HF_SHARD_BYTES / 10**9,
                   help="the most one safetensors file holds, in GB (10^9 bytes); memory holds about one file")
    ns = p.parse_args(argv)
    out_dir = Path(ns.out_dir)
    made = not out_dir.exists()  # a failed conversion leaves no partial output where there was none
    try:
        _convert(ns, out_dir)
    except (ConfigError, FileNotFoundError) as e:  # a bad path or folder; anything else keeps its traceback
        _remove_if_made(out_dir, made)
        print(f"trainlib.convert: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        _remove_if_made(out_dir, made)
        raise
    return 0


def _remove_if_made(out_dir: Path, made: bool) -> None:
    if made and out_dir.is_dir():
        shutil.rmtree(out_dir, ignore_errors=True)


def _convert(ns: argparse.Namespace, out_dir: Path) -> None:
    writable_folder(out_dir, "OUT_DIR", "pick another output folder")  # before anything is read
    if ns.cmd == "hf-to-dcp":
        args = hf_to_dcp(ns.hf_dir, ns.out_dir)
        print(f"wrote DCP checkpoint {ns.out_dir} ({spec_of_args(args).name}, n_layers={args.n_layers}, "
              f"vocab_size={args.vocab_size})")
        return
    ckpt = Path(ns.checkpoint_dir)
    saved = saved_model_args(ckpt)
    if ns.flavor is not None:
        if ns.model is None and saved is None:
            raise ConfigError(f"{ckpt} does not record its model family: pass --model "
                              f"({', '.join(sorted(MODELS))}) with --flavor")
        name = ns.model or spec_of_args(saved).name
        args = get_model_spec(name).get_args(ns.flavor)
        if saved is not None:  # another family or shape than the checkpoint's would be written over its weights
            check_model_args(saved, args, str(ckpt), builds="this export asks for",
                             fix="drop --model and --flavor: the checkpoint records its own model")
    elif saved is None:
        args = _args_from_run_config(ckpt)
        if args is None:
            raise ConfigError(f"{ckpt} does not record the model shape and no run config.toml is two folders "
                              "up: pass --model and --flavor")
    else:
        args = None  # the checkpoint's own
        if ns.model is not None and ns.model != spec_of_args(saved).name:  # --model alone: not ignored
            raise ConfigError(f"{ckpt} holds a {spec_of_args(saved).name} model, but this export asks for "
                              f"{ns.model}: drop --model: the checkpoint records its own model")
    if not ns.max_shard_gb > 0:
        raise ConfigError(f"--max-shard-gb must be > 0, got {ns.max_shard_gb}")
    out = dcp_to_hf(ckpt, ns.out_dir, args, getattr(torch, ns.dtype) if ns.dtype else None,
                    max_shard_bytes=int(ns.max_shard_gb * 10**9))
    files = sorted(out.glob("*.safetensors"))
    print(f"wrote {len(files)} safetensors file(s) and config.json to {out}")


if __name__ == "__main__":
    sys.exit(main())
