"""Hugging Face / Meta checkpoint files <-> trainlib weights, without a process group.

The name, layout and config.json mapping of each family lives next to its
model, in its `state_dict_adapter` (the model contract,
`trainlib/models/spec.py`); this module picks the family (from config.json's
`architectures`, or from the args' type) and reads and writes the files.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from trainlib.errors import ConfigError
from trainlib.models.registry import MODELS
from trainlib.models.spec import ModelSpec
from trainlib.params import canonical_name, copy_full_


_INDEX = "model.safetensors.index.json"
# What one file of an exported folder holds at most (transformers' save_pretrained shards at 5 GB too).
HF_SHARD_BYTES = 5 * 10**9


def spec_of_args(args: Any) -> ModelSpec:
    """The family whose args dataclass `args` is."""
    for spec in MODELS.values():
        if isinstance(args, spec.args_type):
            return spec
    raise TypeError(f"{type(args).__name__} is no registered family's args type")


def args_from_dict(d: dict, spec: ModelSpec) -> Any:
    """`spec`'s args from a dict of their fields (a checkpoint's trainer.model_args); unknown keys are ignored.
    A field that holds a dataclass (an MoE family's `moe`) comes back from DCP flattened, as `field.key`
    entries: they are regrouped into one dict for that field, which the args type takes."""
    grouped: dict[str, Any] = {}
    for k, v in d.items():
        field_name, dot, key = k.partition(".")
        if dot:
            grouped.setdefault(field_name, {})[key] = v
        else:
            grouped[k] = v
    names = {f.name for f in fields(spec.args_type)}
    return spec.args_type(**{k: v for k, v in grouped.items() if k in names})


def spec_of_hf_config(cfg: dict, path: str | os.PathLike = "config.json") -> ModelSpec:
    """The family that reads a Hugging Face config.json (by its `architectures`,
    else its `model_type`); one that none reads is a ConfigError naming what
    each family reads."""
    archs = cfg.get("architectures") or []
    for spec in MODELS.values():
        adapter = spec.state_dict_adapter
        if any(a in adapter.ARCHITECTURES for a in archs) or (not archs and cfg.get("model_type") == adapter.MODEL_TYPE):
            return spec
    known = "; ".join(f"{s.name}: {', '.join(s.state_dict_adapter.ARCHITECTURES)}" for s in MODELS.values())
    raise ConfigError(f"{path} is a Hugging Face model of architecture {archs or 'unknown (no architectures)'}, "
                      f"which no trainlib family reads ({known}); convert it to one of those first")


def args_from_hf_config(cfg: dict) -> Any:
    """The args of the family that reads this config.json (`spec_of_hf_config`)."""
    return spec_of_hf_config(cfg).state_dict_adapter.args_from_hf_config(cfg)


# --------------------------------------------------------------------------- weights


def checkpoint_format(path: str | os.PathLike) -> Literal["hf", "meta", "dcp"]:
    """What `checkpoint.initial_load_path` points at: a Hugging Face folder
    (config.json + *.safetensors), a Meta reference folder (consolidated.*.pth)
    or a DCP checkpoint folder (.metadata)."""
    if is_hf_folder(path):
        return "hf"
    if is_meta_folder(path):
        return "meta"
    if (Path(path) / ".metadata").is_file():
        return "dcp"
    raise ConfigError(f"checkpoint.initial_load_path={str(path)!r} is neither a DCP checkpoint folder (.metadata), "
                      "a Hugging Face folder (config.json + *.safetensors) nor a Meta folder (consolidated.00.pth)")


def is_hf_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


class LazyWeights(Mapping[str, torch.Tensor]):
    """Weights by trainlib name, each read from disk when it is asked for;
    the names (`_names`) are known without reading any."""

    _names: dict[str, Any]

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class HFWeights(LazyWeights):
    """An HF folder's weights by trainlib name, each read and put in
    trainlib's layout when it is asked for. safetensors memory-maps the files
    (the page cache, shared by a node's ranks, holds them), and the one copy a
    weight may need (wq and wk's rotary permutation) lives until its caller
    drops it: loading a model weight by weight costs a rank about one weight
    of memory, not the model. (It cost every rank the permuted wq and wk of
    all blocks: 72 GB for Llama 3.1 405B in bf16.) A sharded load needs not
    even that: `load_full_state_into_model` gathers from the stored weight
    (`stored`, `row_order`) only the rows of the rank's shard."""

    def __init__(self, file_of: dict[str, Path], args: Any, spec: ModelSpec, config: dict | None = None):
        self.args, self.spec = args, spec
        self._adapter = spec.state_dict_adapter
        self._file_of = file_of  # HF name -> the file holding it
        self._names = self._adapter.hf_weight_names(file_of, args)  # trainlib name -> HF name
        # Block-quantized float8 weights (config.json's quantization_config: fp8 with weight_block_size, as
        # the hub's DeepSeek-V3 holds them): each `<name>` in float8 has a `<name>_scale_inv` of one factor
        # per block, and is read dequantized to the checkpoint's own dtype (`torch_dtype`).
        quant = (config or {}).get("quantization_config") or {}
        self._block = tuple(quant.get("weight_block_size") or (128, 128))
        dtype = (config or {}).get("torch_dtype") or (config or {}).get("dtype") or "float32"
        self._dequantized = getattr(torch, dtype) if isinstance(dtype, str) else torch.float32

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.convert(name, self.stored(name))

    def convert(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """`self[name]` made from `stored`, a tensor `stored(name)` returned: its file is not opened again."""
        return self._adapter.hf_weight_to_trainlib(name, stored, self.args)

    def stored(self, name: str) -> torch.Tensor:
        """Weight `name` as the file stores it (HF's layout), memory-mapped:
        its pages are read when touched. Same shape and dtype as `self[name]`
        (the rotary permutation moves rows within a head). A weight the
        adapter names by a tuple of HF names (an MoE layer's experts, one
        tensor each in HF's files) is theirs stacked on a new first
        dimension in that order: a copy, of that one weight."""
        from safetensors import safe_open

        theirs = self._names[name]
        if isinstance(theirs, str):
            with safe_open(str(self._file_of[theirs]), framework="pt") as handle:
                return self._dequantize(theirs, handle.get_tensor(theirs))
        by_file: dict[Path, list[tuple[int, str]]] = {}
        for i, part in enumerate(theirs):
            by_file.setdefault(self._file_of[part], []).append((i, part))
        out = None
        for file, parts in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for i, part in parts:
                    t = self._dequantize(part, handle.get_tensor(part))
                    if out is None:
                        out = torch.empty((len(theirs), *t.shape), dtype=t.dtype)
                    out[i] = t
        return out

    def _dequantize(self, hf_name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (HF weight `hf_name`), times its block scales when it is float8 with a `_scale_inv` beside it:
        a copy in the checkpoint's dtype; anything else as it is."""
        scale_name = hf_name + "_scale_inv"
        if t.element_size() != 1 or not t.is_floating_point() or scale_name not in self._file_of:
            return t
        from safetensors import safe_open

        with safe_open(str(self._file_of[scale_name]), framework="pt") as handle:
            scale = handle.get_tensor(scale_name).float()
        rows, cols = self._block
        full = scale.repeat_interleave(rows, 0)[:t.shape[0]].repeat_interleave(cols, 1)[:, :t.shape[1]]
        return (t.float() * full).to(self._dequantized)

    def planned(self, name: str) -> torch.Tensor:
        """What a save can be planned on for weight `name` without reading it:
        `stored(name)` (mapped), or for a stacked or float8 weight a meta
        tensor of its shape and dtype (`stored` would make a copy)."""
        from safetensors import safe_open

        theirs = self._names[name]
        first = theirs if isinstance(theirs, str) else theirs[0]
        quantized = first + "_scale_inv" in self._file_of
        if isinstance(theirs, str) and not quantized:
            return self.stored(name)
        with safe_open(str(self._file_of[first]), framework="pt") as handle:
            piece = handle.get_slice(first)
            shape = tuple(piece.get_shape())
            dtype = self._dequantized if quantized else handle.get_tensor(first).dtype
        shape = shape if isinstance(theirs, str) else (len(theirs), *shape)
        return torch.empty(shape, dtype=dtype, device="meta")

    def row_order(self, name: str) -> torch.Tensor | None:
        """Which stored row each of `self[name]`'s rows is (None: the same)."""
        return self._adapter.hf_row_order(name, self.args)


def read_hf_folder(path: str | os.PathLike) -> tuple[Any, HFWeights]:
    """(model shape, trainlib-named full tensors, read on access) from an HF
    folder, sharded (`model.safetensors.index.json`) or not; the family is
    the one that reads its config.json (`HFWeights.spec`). The folder is
    checked whole first, each fault one line naming the file and the field
    (`check_hf_weights`): a value of config.json that is a string where a
    number belongs, a safetensors file cut short or damaged, an index naming
    a tensor its file lacks, a tensor config.json's model has and no file
    holds, one it does not have, one of another shape."""
    path = Path(path)
    if not is_hf_folder(path):
        raise ConfigError(f"{path} is not a Hugging Face checkpoint folder: expected config.json and *.safetensors")
    config = _read_json(path / "config.json")
    _refuse_numbers_as_strings(config, path / "config.json")
    spec = spec_of_hf_config(config, path / "config.json")
    args = spec.state_dict_adapter.args_from_hf_config(config)
    index = path / _INDEX
    if not index.is_file():  # one file, or files without an index: their headers name their tensors
        files = sorted(path.glob("*.safetensors"))
        held = {f: safetensors_header(f) for f in files}
        file_of = {name: f for f, header in held.items() for name in header}
        where = files[0] if len(files) == 1 else path
    else:
        index_json = _read_json(index)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no weight_map: a damaged index; fetch it again")
        absent = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if absent:
            raise ConfigError(f"{index} lists {len(absent)} file(s) the folder lacks ({', '.join(absent[:3])}"
                              f"{', ...' if len(absent) > 3 else ''}): an incomplete download or copy; fetch them")
        # the index's files: others may be stale
        held = {path / f: safetensors_header(path / f) for f in sorted(set(weight_map.values()))}
        for name, f in weight_map.items():
            if name not in held[path / f]:
                raise ConfigError(f"{index} names {name} in {f}, which does not hold it: an index of other files "
                                  f"(an incomplete download or copy); fetch the folder again")
        file_of, where = {name: path / f for name, f in weight_map.items()}, index
    shapes = {name: held[f][name] for name, f in file_of.items()}
    check_hf_weights(spec, args, shapes, file_of, where)
    return args, HFWeights(file_of, args, spec, config)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}): a damaged download; fetch it again") from None


_NUMBER = re.compile(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*")


def _refuse_numbers_as_strings(config: Any, path: Path, prefix: str = "") -> None:
    """One line for a value of config.json (or of a section in it) that is a number written as a string
    ("64"): families read the numbers as they are, and a string would fail deep inside torch."""
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object: a damaged download; fetch it again")
    for key, value in config.items():
        if isinstance(value, dict):
            _refuse_numbers_as_strings(value, path, f"{prefix}{key}.")
        elif isinstance(value, str) and _NUMBER.fullmatch(value):
            raise ConfigError(f"{path}: {prefix}{key} is the string {value!r} where a number belongs; write it "
                              f"without quotes ({value.strip()})")


def safetensors_header(file: Path) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's header, read without torch; a file that is not one, or
    is shorter than its header says (cut by an interrupted download or copy), is one line."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        raw = f.read(n) if n is not None and n <= size - 8 else b""
    try:
        header = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{file} is not a safetensors file ({size} bytes, no readable header): a damaged or "
                          f"incomplete download; fetch it again")
    header.pop("__metadata__", None)
    entries = header.values()
    if not all(isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("data_offsets"), list)
               and len(v["data_offsets"]) == 2 for v in entries):
        raise ConfigError(f"{file} is not a safetensors file (its header lists no tensors' shapes and offsets): "
                          f"a damaged download; fetch it again")
    end = 8 + n + max((v["data_offsets"][1] for v in entries), default=0)
    if size < end:
        raise ConfigError(f"{file} is cut short: {size} bytes, its header describes {end}: an interrupted "
                          f"download or copy; fetch it again")
    return {name: v["shape"] for name, v in header.items()}


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def check_hf_weights(spec: ModelSpec, args: Any, shapes: dict[str, list[int]], file_of: dict[str, Path],
                     where: Path) -> None:
    """One line when the tensors of an HF folder (`shapes`: HF name -> shape, `file_of`: HF name -> file) are
    not those its config.json describes (`args`): a tensor the model has that no file holds, a tensor no
    part of the model explains (experts, layers beyond the config's), or one of another shape (heads). An
    old export's rotary inv_freq buffers are not weights and are let through. `where` names the files
    (the one file, or the index)."""
    adapter = spec.state_dict_adapter
    with torch.device("meta"):
        model = spec.model_cls(args, rope_len=1)
    ours = {name: list(t.shape) for name, t in model.state_dict().items()}
    expected: dict[str, list[int]] = {}  # HF name -> shape, of everything the model's HF folder holds
    for name, theirs in adapter.trainlib_weight_names(ours, args).items():
        for hf in ([theirs] if isinstance(theirs, str) else theirs):
            expected[hf] = ours[name] if isinstance(theirs, str) else ours[name][1:]
    missing = sorted((n for n in expected if n not in shapes), key=_natural)
    if missing:
        raise ConfigError(f"{where} lacks {len(missing)} tensor(s) config.json's model has ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): an incomplete download or copy, or a config.json "
                          f"that does not describe these weights")
    # Further copies of a model weight the family's folders hold (the hub's DeepSeek-style MTP layers keep the
    # embedding and output head again), needed by no import; a float8 weight's block scales
    copies = getattr(adapter, "hf_weight_copies", None)
    copy_shapes = {hf: ours[name] for name, hfs in (copies(args).items() if copies else ()) if name in ours
                   for hf in hfs}

    def explained(hf: str) -> bool:  # e.g. a tied model's lm_head, which some exports keep: a weight of the model
        if hf in copy_shapes:
            return list(shapes[hf]) == copy_shapes[hf]
        if hf.endswith("_scale_inv") and hf.removesuffix("_scale_inv") in expected:
            return True
        return any(isinstance(theirs, str) and name in ours and list(shapes[hf]) == ours[name]
                   for name, theirs in adapter.hf_weight_names([hf], args).items())

    extra = sorted((n for n in shapes if n not in expected and not n.endswith("inv_freq") and not explained(n)),
                   key=_natural)
    if extra:
        raise ConfigError(f"{where} holds {len(extra)} tensor(s) config.json's model does not have "
                          f"({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): a config.json that does not "
                          f"describe these weights (its expert, layer or head counts?)")
    for name, shape in expected.items():
        if list(shapes[name]) != shape:
            raise ConfigError(f"{file_of[name]} holds {name} of shape {list(shapes[name])}, config.json's model has "
                              f"{shape}: a config.json that does not describe these weights (its head counts or "
                              f"widths?)")


def write_hf_folder(sd: Mapping[str, torch.Tensor], args: Any, out_dir: str | os.PathLike, *,
                    dtype: torch.dtype | None = None, max_shard_bytes: int = HF_SHARD_BYTES) -> Path:
    """`config.json` and the weights in safetensors files of at most
    `max_shard_bytes` each (a bigger tensor gets a file of its own): one
    `model.safetensors`, or `model-0000i-of-0000n.safetensors` and their
    `model.safetensors.index.json`, as transformers writes them. Weights are
    cast to `dtype` (default: their own) and asked of `sd` one file's worth
    at a time: with a Mapping that reads on access (`DCPWeights`, or one
    with a `read_many(names)`), memory holds one file's weights (in their
    own dtype, and cast), not the model. Files of an earlier export in
    `out_dir` are replaced. The family is the one whose args `args` are."""
    from safetensors.torch import save_file

    spec = spec_of_args(args)
    adapter = spec.state_dict_adapter
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_name = adapter.trainlib_weight_names(sd, args)
    # trainlib name -> further HF names the format stores the same tensor under (optional in an adapter)
    copies = adapter.hf_weight_copies(args) if hasattr(adapter, "hf_weight_copies") else {}
    names = sorted(hf_name, key=lambda name: _file_order(name, spec))
    specs = {name: _spec(sd, name) for name in names}
    out_dtype = dtype or specs[names[0]][1]
    files = _shards(names, lambda n: specs[n][0].numel() * out_dtype.itemsize, max_shard_bytes)
    file_names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    for stale in [out / _INDEX, *out.glob("model.safetensors"), *out.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    weight_map, total = {}, 0
    for file_name, file in zip(file_names, files):
        tensors = sd.read_many(file) if hasattr(sd, "read_many") else {name: sd[name] for name in file}
        hf = {}
        for name, t in tensors.items():
            t, theirs = adapter.trainlib_weight_to_hf(name, t.to(out_dtype), args), hf_name[name]
            if isinstance(theirs, str):
                hf[theirs] = t.contiguous()
                # the same tensor stored again under other names (a family's `hf_weight_copies`), each a clone
                hf.update({other: t.clone() for other in copies.get(name, ())})
            else:  # one HF tensor per slice of the first dimension (an MoE layer's experts), each a
                # clone: safetensors refuses tensors that share memory
                hf.update(zip(theirs, (piece.clone() for piece in t.unbind(0)), strict=True))
        del tensors
        save_file(hf, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(hf, file_name))
        total += sum(t.numel() * t.element_size() for t in hf.values())
        del hf
    if len(files) > 1:
        (out / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
                                  + "\n")
    config = adapter.hf_config_from_args(args, str(out_dtype).replace("torch.", ""))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _spec(sd: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Size, torch.dtype]:
    """Shape and dtype of `sd[name]`, without reading it where `sd` can tell (`spec`)."""
    if hasattr(sd, "spec"):
        return sd.spec(name)
    return sd[name].shape, sd[name].dtype


def _file_order(name: str, spec: ModelSpec) -> tuple:
    """The first stage's root modules (the embedding), blocks in order, the
    rest (final norm, output): files hold neighbouring blocks."""
    parts = name.split(".")
    if parts[0] == "layers":
        return (1, int(parts[1]), name)
    return (0 if parts[0] in spec.stage_roots.first else 2, 0, name)


def _shards(names: list[str], nbytes, limit: int) -> list[list[str]]:
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        if files[-1] and size + nbytes(name) > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes(name)
    return files


# The [model] keys a recipe may set on top of a flavor (trainlib.config.job.ModelConfig): the args fields a
# user overrides explicitly.
OVERRIDABLE = ("n_layers", "vocab_size")


def arg_fields(args: Any) -> dict[str, Any]:
    """A family's args as {field: value}, a dataclass field (an MoE family's `moe`) flattened as `moe.key`."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        if is_dataclass(value):
            out.update({f"{f.name}.{k}": v for k, v in arg_fields(value).items()})
        else:
            out[f.name] = value
    return out


def flavor_of(args: Any) -> tuple[str | None, dict[str, Any]]:
    """(the shipped flavor of `args`' family whose fields are `args`' but for the OVERRIDABLE ones, and those
    that differ from it as {field: args' value}); (None, {}) when no flavor has the other fields."""
    from trainlib.models.flavors import FAMILIES

    family = FAMILIES.get(spec_of_args(args).name)
    mine = arg_fields(args)
    for name, flavor in (family.FLAVORS.items() if family is not None else ()):
        theirs = arg_fields(flavor)
        if all(v == theirs.get(k) for k, v in mine.items() if k not in OVERRIDABLE):
            return name, {k: mine[k] for k in OVERRIDABLE if k in mine and mine[k] != theirs.get(k)}
    return None, {}


def check_model_args(saved: Any, expected: Any, source: str, overrides: tuple[str, ...] = (),
                     builds: str = "this run builds", fix: str | None = None) -> dict[str, tuple[Any, Any]]:
    """One line when the model a checkpoint records (`saved`) is not the one this run builds (`expected`):
    another family, or any field of another value, shape or not (top_k, rope_theta, ... change what the
    weights compute without changing their shapes). The line names the fields, both values and the fix: the
    shipped flavor with the checkpoint's values (and the n_layers / vocab_size to set), or that none has
    them. Fields the user set explicitly (`overrides`, of OVERRIDABLE) may differ: returned as {field:
    (checkpoint's, run's)} for the caller's start-up line. `builds` and `fix` word the line for a caller
    that is not a run (an export)."""
    have, want = spec_of_args(saved), spec_of_args(expected)
    if have is not want:
        raise ConfigError(f"{source} holds a {have.name} model, but {builds} {want.name}: " + (fix or (
            f"set model.name = '{have.name}' (and its flavor), or load a {want.name} checkpoint")))
    a, b = arg_fields(saved), arg_fields(expected)
    differ = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    # by design: a tied checkpoint starts an untied model (its output starts as the embedding)
    allowed = set(overrides) | ({"tie_embeddings"} if a.get("tie_embeddings") is True else set())
    if set(differ) <= allowed:
        theirs, ours = _param_shapes(want, saved), _param_shapes(want, expected)
        bad = next((n for n, shape in ours.items() if theirs.get(n, shape) != shape), None)
        if bad is not None:  # the run's weights must be the checkpoint's, or some of them
            raise ConfigError(f"{source} holds {bad} of shape {list(theirs[bad])}, but this run's model.{differ[0]} "
                              f"= {b[differ[0]]} makes it {list(ours[bad])}: set model.{differ[0]} = {a[differ[0]]}")
        return {k: (a.get(k), b.get(k)) for k in differ}
    run_flavor, _ = flavor_of(expected)
    show = lambda d: " ".join(f"{k}={d.get(k)}" for k in differ)  # noqa: E731
    if fix is None:
        name, _ = flavor_of(saved)
        keys = [f"model.flavor = '{name}'"] if name != run_flavor else []
        keys += [f"model.{k} = {a[k]}" for k in OVERRIDABLE if k in a and a[k] != b.get(k)]
        fix = ("set " + " and ".join(keys) if name is not None else
               f"no shipped {want.name} flavor has the checkpoint's values: set model.flavor = 'from_checkpoint' "
               f"to train the checkpoint's own shape (with it as checkpoint.initial_load_path; "
               f"docs/checkpointing.md), or load a checkpoint of this run's model")
    raise ConfigError(f"{source} holds a model of {show(a)}, but {builds} {show(b)} ({want.name}"
                      + (f" flavor '{run_flavor}'" if run_flavor else "") + f"): {fix}")


def check_shapes(args: Any, expected: Any, source: str) -> None:
    """`check_model_args` without overrides (every field, not only the shapes, whatever the name says)."""
    check_model_args(args, expected, source)


def _param_shapes(spec: ModelSpec, args: Any) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = spec.model_cls(args, rope_len=1)
    # every holder of a tied matrix by its name: a tied checkpoint may start an untied model
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def load_full_state_into_model(model_parts: list[nn.Module], sd: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy full (unsharded) tensors, keyed by canonical name, into possibly
    sharded parameters: each rank keeps its own shard, no communication. One
    tensor of `sd` is asked for at a time (`HFWeights` reads on access). A
    weight `source` lacks is a ConfigError, before any is copied."""
    params = [(canonical_name(name), p) for part in model_parts for name, p in part.named_parameters()]
    lacking = [name for name, _ in params if name not in sd]
    if lacking:
        raise ConfigError(f"{source} lacks {len(lacking)} weight(s) this model has ({', '.join(lacking[:3])}"
                          f"{', ...' if len(lacking) > 3 else ''}): point checkpoint.initial_load_path at a whole "
                          "checkpoint of this model")
    # persistent buffers the source holds too (an MoE's load-balance bias where the format stores it)
    buffers = [(canonical_name(name), b) for part in model_parts for name, b in part.named_buffers()
               if canonical_name(name) in sd]
    for name, p in params + buffers:
        if isinstance(sd, HFWeights):  # as stored: a shard's rows are put in trainlib's order, never the whole
            copy_full_(p, sd.stored(name), sd.row_order(name))
        else:
            copy_full_(p, sd[name])


def load_hf_into_model(model_parts: list[nn.Module], path: str | os.PathLike, expected: Any = None,
                       overrides: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """Load an HF folder's weights into the model of shape `expected` (its fields checked against the folder's
    config.json: `check_model_args`); returns the overridden fields that differ."""
    args, sd = read_hf_folder(path)
    changed = check_model_args(args, expected, f"HF checkpoint {path}", overrides) if expected is not None else {}
    load_full_state_into_model(model_parts, sd, f"HF checkpoint {path}")
    return changed


# --------------------------------------------------------------------------- Meta format


def is_meta_folder(path: str | os.PathLike) -> bool:
    return any(Path(path).glob("consolidated.*.pth"))


def load_meta_into_model(model_parts: list[nn.Module], path: str | os.PathLike, expected: Any) -> None:
    """Weights from a Meta reference checkpoint folder (`consolidated.00.pth`
    [+ params.json]), read by the run's family (`expected`'s) where its
    adapter has `read_meta_checkpoint(path, expected) -> (args, weights)`."""
    spec = spec_of_args(expected)
    read = getattr(spec.state_dict_adapter, "read_meta_checkpoint", None)
    if read is None:
        raise ConfigError(f"{path} is a Meta reference checkpoint (consolidated.*.pth), which the {spec.name} family "
                          f"does not read; point checkpoint.initial_load_path at a Hugging Face or DCP checkpoint")
    files = sorted(Path(path).glob("consolidated.*.pth"))
    if len(files) != 1:
        raise ConfigError(f"{path} holds {len(files)} consolidated.*.pth files (model-parallel shards); only "
                          "single-file Meta checkpoints load directly: convert larger ones to HF format first")
    args, sd = read(files[0], expected)
    check_model_args(args, expected, f"Meta checkpoint {path}")
    load_full_state_into_model(model_parts, sd, f"Meta checkpoint {path}")
