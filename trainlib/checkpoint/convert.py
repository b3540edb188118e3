"""Hugging Face safetensors <-> trainlib DCP checkpoints, in one process.

No GPUs and no process group: a (possibly sharded) checkpoint is read whole
from disk. `python -m trainlib.convert` is the command line over these.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainlib.checkpoint.hf import args_from_dict, read_hf_folder, write_hf_folder
from trainlib.checkpoint.state import TrainState
from trainlib.errors import ConfigError
from trainlib.models.llama3.model import ModelArgs

_ARGS_PREFIX = "trainer.model_args."


def hf_to_dcp(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> ModelArgs:
    """An HF folder (config.json + *.safetensors, sharded or not) as a DCP
    checkpoint holding the model and its shape; start training from it with
    `checkpoint.initial_load_path=OUT_DIR`."""
    args, sd = read_hf_folder(hf_dir)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dcp.save({"model": dict(sd), "trainer": TrainState(model_args=args)}, checkpoint_id=str(out_dir), no_dist=True)
    return args


def _metadata(ckpt_dir: Path) -> dict:
    if not (ckpt_dir / ".metadata").is_file():
        raise ConfigError(f"{ckpt_dir} is not a complete DCP checkpoint (no .metadata): pass a step-N folder")
    return FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata


def saved_model_args(ckpt_dir: str | os.PathLike) -> ModelArgs | None:
    """The model shape a checkpoint records (trainer.model_args), or None."""
    sd = {k: None for k in _metadata(Path(ckpt_dir)) if k.startswith(_ARGS_PREFIX)}
    if not sd:
        return None
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    return args_from_dict({k[len(_ARGS_PREFIX):]: v for k, v in sd.items()})


def read_dcp_model(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Full model tensors by trainlib name, read in this process from however
    many shards the checkpoint has."""
    meta = _metadata(Path(ckpt_dir))
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise ConfigError(f"{ckpt_dir} holds no model tensors (keys model.*): not a trainlib checkpoint")
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    return {k[len("model."):]: v for k, v in sd.items()}


def dcp_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, args: ModelArgs | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """One consolidated `model.safetensors` + `config.json` that
    `transformers.LlamaForCausalLM.from_pretrained` loads. The shape is `args`
    if given, else the one the checkpoint records."""
    if args is None:
        args = saved_model_args(ckpt_dir)
        if args is None:
            raise ConfigError(f"{ckpt_dir} does not record the model shape: give it (--flavor)")
    sd = read_dcp_model(ckpt_dir)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return write_hf_folder(sd, args, out_dir)
