"""Hugging Face safetensors <-> trainlib DCP checkpoints, in one process.

No GPUs and no process group: a (possibly sharded) checkpoint is read from
disk in this one process, one HF file's worth of weights at a time.
`python -m trainlib.convert` is the command line over these.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainlib.checkpoint.hf import (
    HF_SHARD_BYTES,
    HFWeights,
    LazyWeights,
    _read_json,
    _refuse_numbers_as_strings,
    args_from_dict,
    checkpoint_format,
    read_hf_folder,
    spec_of_args,
    spec_of_hf_config,
    write_hf_folder,
)
from trainlib.checkpoint.state import TrainState
from trainlib.errors import ConfigError
from trainlib.models.registry import MODELS, get_model_spec

_ARGS_PREFIX = "trainer.model_args."
_NAME_KEY = "trainer.model_name"


@contextlib.contextmanager
def _one_process():
    """DCP's save and load here, in one process on purpose (no_dist=True), without DCP's warning that
    "torch.distributed is disabled ... assuming the intent is to save/load in a single process": torch 2.13
    warns even when no_dist is passed, so every conversion printed it (twice for hf-to-dcp, once per export
    file for dcp-to-hf); the intent is stated, and only that message is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def hf_to_dcp(hf_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Any:
    """An HF folder (config.json + *.safetensors, sharded or not) as a DCP
    checkpoint holding the model and its shape; start training from it with
    `checkpoint.initial_load_path=OUT_DIR`.

    Memory holds about one weight: the save is planned on the files' mapped
    tensors, each weight is put in trainlib's layout only when the writer asks
    for it (`_ConvertOnWrite`), and each goes to a file of its own, since DCP's
    writer keeps a file's tensors until the file is written. (Converted
    eagerly, all blocks' permuted wq and wk were held at once: 72 GB for
    Llama 3.1 405B in bf16.) A weight stacked from several HF tensors (an
    MoE layer's experts) is planned on a meta tensor and stacked when the
    writer asks for it. Persistent buffers the HF format has no counterpart
    for (an MoE layer's load-balance bias) are saved at their initial value,
    so the checkpoint holds every key of the model's state dict."""
    args, sd = read_hf_folder(hf_dir)
    model = {name: sd.planned(name) for name in sd}
    model.update(_initial_buffers(sd.spec, args, model))
    with _one_process():
        dcp.save({"model": model, "trainer": TrainState(model_args=args, model_name=sd.spec.name)},
                 storage_writer=FileSystemWriter(str(out_dir), single_file_per_rank=False),
                 planner=_ConvertOnWrite(sd), no_dist=True)
    return args


def _initial_buffers(spec, args: Any, weights) -> dict[str, torch.Tensor]:
    """The persistent buffers of `spec`'s model of shape `args` that `weights` lacks, at their initial
    values (`init_buffers`), built on the meta device (no weight is allocated)."""
    with torch.device("meta"):
        model = spec.model_cls(args, rope_len=1)
    model.init_buffers(device="cpu")
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {name: t for name, t in model.state_dict().items() if name not in params and name not in weights}


class _ConvertOnWrite(DefaultSavePlanner):
    """Hands the writer each model weight of `weights` in trainlib's layout,
    converted when asked for from the stored tensor the planned state dict
    holds (same shape and dtype; its file is not opened again), or, planned
    on a meta tensor (a stacked weight), read when asked for."""

    def __init__(self, weights: HFWeights):
        super().__init__()
        self._weights = weights

    def lookup_object(self, index):
        stored = super().lookup_object(index)
        name = index.fqn.removeprefix("model.")
        if index.fqn.startswith("model.") and name in self._weights:
            return self._weights.convert(name, self._weights.stored(name) if stored.is_meta else stored)
        return stored


class _OneMetadataReader(FileSystemReader):
    """Reads `.metadata` once for all the loads of one conversion (a large
    checkpoint's metadata lists every rank's chunk of every tensor)."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, "_metadata_once"):
            self._metadata_once = super().read_metadata(*args, **kwargs)
        return self._metadata_once


def _open(ckpt_dir: str | os.PathLike) -> _OneMetadataReader:
    if not (Path(ckpt_dir) / ".metadata").is_file():
        raise ConfigError(f"{ckpt_dir} is not a complete DCP checkpoint (no .metadata): pass a step-N folder")
    return _OneMetadataReader(str(ckpt_dir))


def saved_model_args(ckpt_dir: str | os.PathLike, reader: FileSystemReader | None = None) -> Any | None:
    """The model a checkpoint records (its family's args: trainer.model_name
    and trainer.model_args), or None; read through `reader` where one is open
    on the checkpoint. A checkpoint that records the args but not the family
    (written before families were recorded) is given the one family whose
    args have exactly those fields."""
    reader = reader or _open(ckpt_dir)
    keys = reader.read_metadata().state_dict_metadata
    sd = {k: None for k in keys if k.startswith(_ARGS_PREFIX) or k == _NAME_KEY}
    if not any(k.startswith(_ARGS_PREFIX) for k in sd):
        return None
    with _one_process():
        dcp.load(sd, storage_reader=reader, no_dist=True)
    values = {k[len(_ARGS_PREFIX):]: v for k, v in sd.items() if k.startswith(_ARGS_PREFIX)}
    if _NAME_KEY in sd:
        spec = get_model_spec(sd[_NAME_KEY])
    else:
        matches = [s for s in MODELS.values() if {f.name for f in fields(s.args_type)} == set(values)]
        if len(matches) != 1:
            return None
        (spec,) = matches
    return args_from_dict(values, spec)


_RECORDED: dict[tuple, Any] = {}


def recorded_model_args(path: str | os.PathLike) -> Any:
    """The model shape `path` (checkpoint.initial_load_path) records, as its family's args: an HF folder's
    config.json (checked as a load checks it) or a DCP checkpoint's recorded args; what model.flavor =
    'from_checkpoint' trains. Read once per file version (the planner asks once per layout)."""
    fmt = checkpoint_format(path)
    marker = Path(path) / ("config.json" if fmt == "hf" else ".metadata")
    key = (str(Path(path).resolve()), fmt, marker.stat().st_mtime_ns if marker.exists() else 0)
    if key not in _RECORDED:
        if fmt == "hf":
            config = _read_json(marker)
            _refuse_numbers_as_strings(config, marker)
            args = spec_of_hf_config(config, marker).state_dict_adapter.args_from_hf_config(config)
        elif fmt == "dcp":
            args = saved_model_args(path)
            if args is None:
                raise ConfigError(f"checkpoint {path} does not record its model's shape (written before trainlib "
                                  "recorded it), so model.flavor = 'from_checkpoint' has none to take: name the "
                                  "model.flavor it was trained with")
        else:
            raise ConfigError(f"checkpoint.initial_load_path={str(path)!r} is a Meta folder, whose shape "
                              "model.flavor = 'from_checkpoint' does not read: name its model.flavor, or convert it to a "
                              "Hugging Face folder first")
        _RECORDED[key] = args
    return _RECORDED[key]


class DCPWeights(LazyWeights):
    """A DCP checkpoint's model tensors by trainlib name, read from disk when
    asked for: `read_many(names)` reads several in one pass (only their bytes),
    `spec(name)` gives a shape and dtype without reading. The checkpoint's
    metadata is read once."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.reader = _open(ckpt_dir)
        meta = self.reader.read_metadata().state_dict_metadata
        self._names = {k[len("model."):]: (m.size, m.properties.dtype) for k, m in meta.items()
                       if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
        if not self._names:
            raise ConfigError(f"{ckpt_dir} holds no model tensors (keys model.*): not a trainlib checkpoint")

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        return self._names[name]

    def read_many(self, names) -> dict[str, torch.Tensor]:
        sd = {f"model.{n}": torch.empty(self._names[n][0], dtype=self._names[n][1]) for n in names}
        with _one_process():
            dcp.load(sd, storage_reader=self.reader, no_dist=True)
        return {k[len("model."):]: v for k, v in sd.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read_many([name])[name]


def read_dcp_model(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Full model tensors by trainlib name, read in this process from however
    many shards the checkpoint has: all of them at once (`DCPWeights` reads
    some at a time)."""
    weights = DCPWeights(ckpt_dir)
    return weights.read_many(list(weights))


def dcp_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, args: Any | None = None,
              dtype: torch.dtype | None = None, max_shard_bytes: int = HF_SHARD_BYTES) -> Path:
    """An HF folder (`config.json` and safetensors files of at most
    `max_shard_bytes`, `write_hf_folder`) that the family's transformers
    class loads with `from_pretrained`. The family and shape are `args` if
    given, else the ones the checkpoint records. Read and written one file's
    worth of weights at a time: memory holds one file's weights, not the
    model (a Llama 3.1 405B checkpoint is 1.6 TB in fp32)."""
    weights = DCPWeights(ckpt_dir)
    if args is None:
        args = saved_model_args(ckpt_dir, weights.reader)
        if args is None:
            raise ConfigError(f"{ckpt_dir} does not record the model shape: give it (--flavor)")
    check_weights_fit(weights, args, str(ckpt_dir))  # before anything is written
    return write_hf_folder(weights, args, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


def check_weights_fit(weights: DCPWeights, args: Any, source: str) -> None:
    """One line when a checkpoint's model tensors are not those of the model `args` describe (a weight it
    lacks, holds in another shape, or holds beyond that model's), before an export writes a config over
    weights it does not describe."""
    spec = spec_of_args(args)
    with torch.device("meta"):
        model = spec.model_cls(args, rope_len=1)
    want = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    for name, shape in want.items():
        if name not in weights:
            raise ConfigError(f"{source} has no {name}, which a {spec.name} model of these args holds: give the "
                              f"--model and --flavor it was trained with")
        if tuple(weights.spec(name)[0]) != shape:
            raise ConfigError(f"{source} holds {name} of shape {list(weights.spec(name)[0])}, a {spec.name} model "
                              f"of these args {list(shape)}: give the --model and --flavor it was trained with")
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ConfigError(f"{source} holds {len(extra)} weight(s) a {spec.name} model of these args does not "
                          f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): give the --model and "
                          f"--flavor it was trained with")
