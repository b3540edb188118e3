"""The parts of a training run that a checkpoint holds, as `Stateful` objects.

Each part follows torch.distributed.checkpoint's `Stateful` protocol:
`state_dict()` gives the tensors and values to save (DCP also calls it on load,
to get tensors to load into in place), `load_state_dict(sd)` takes them back.
The learning-rate scheduler and `PackedDataLoader` already have both methods;
the model, the optimizer and the run's own position need the adapters here.
`Checkpointer` saves each part under its key (`model`, `optimizer`, ...).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from trainlib.errors import ConfigError
from trainlib.params import canonical_name

logger = logging.getLogger("trainlib")


class ModelState:
    """All model parts (one model, or this rank's pipeline stages) as one state
    dict keyed by canonical names (`layers.3.attention.wq.weight`), sharded as
    they live (FSDP/TP DTensors); DCP reshards them on load."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {}
        for part in self.model_parts:
            sd.update(get_model_state_dict(part))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # strict=False: each part takes its own keys (PP stages hold disjoint blocks).
        for part in self.model_parts:
            set_model_state_dict(part, sd, options=StateDictOptions(strict=False))


# AdamW's hyper-parameters a checkpoint records in its param groups (the run's config sets them); an
# optimizer declares its own (trainlib.optim.OptimizerKind.hyper_parameters).
HYPER_PARAMETERS = ("betas", "eps", "weight_decay", "amsgrad", "maximize")


def _plain(v: Any) -> Any:
    """A param group's value as saved and as set compare alike (a checkpoint holds tuples as lists)."""
    return list(v) if isinstance(v, (tuple, list)) else v


class OptimizerState:
    """One optimizer's per-parameter state keyed `<canonical param name>.<state key>`,
    plus the param groups' hyper-parameters.

    torch's `get_optimizer_state_dict` maps parameters through ONE module;
    under PP a single optimizer spans several stage modules, so the (small)
    mapping is done here, with the model's names. `hyper_parameters`: the param-group keys a resume
    compares with the run's own (the optimizer's declaration, trainlib.optim.OptimizerKind)."""

    def __init__(self, model_parts: list[nn.Module], optimizer: torch.optim.Optimizer,
                 hyper_parameters: tuple[str, ...] = HYPER_PARAMETERS):
        self.model_parts, self.optimizer = model_parts, optimizer
        self.hyper_parameters = hyper_parameters

    def _names(self) -> dict[int, str]:
        # PP stages hold disjoint blocks keyed by global index, so names stay unique.
        names = {}
        for part in self.model_parts:
            for name, p in part.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), canonical_name(name))
        return names

    def state_dict(self) -> dict[str, Any]:
        self._ensure_state()
        names = self._names()
        state = {f"{names[id(p)]}.{k}": v for p, s in self.optimizer.state.items() for k, v in s.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        names = self._names()
        for p, s in self.optimizer.state.items():
            for k in s:
                s[k] = sd["state"][f"{names[id(p)]}.{k}"]
        if len(sd["param_groups"]) != len(self.optimizer.param_groups):
            raise ConfigError(f"checkpoint has {len(sd['param_groups'])} optimizer param groups, this optimizer has "
                              f"{len(self.optimizer.param_groups)}: resume with the same optimizer settings")
        # The hyper-parameters are the run's ([optimizer]), not the checkpoint's: an override on resume takes
        # effect, and says so. The rates are the schedule's (trainlib.optim.LRSchedule sets them on its load).
        changed = {}
        for i, (g, saved) in enumerate(zip(self.optimizer.param_groups, sd["param_groups"])):
            for k in self.hyper_parameters:
                if k in saved and k in g and _plain(saved[k]) != _plain(g[k]):
                    changed[k] = (_plain(saved[k]), _plain(g[k]))
        if changed:
            logger.warning("resumed with other optimizer settings than the checkpoint's run ("
                           + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items()))
                           + "): the new ones apply from the resumed step on")

    def _ensure_state(self) -> None:
        """A fresh optimizer has no state tensors for DCP to load into: create
        them (with the parameters' sharding) by one step with zero gradients
        and lr 0, as torch's own `get_optimizer_state_dict` does. Saves come
        after real steps, so only loads take this path."""
        if self.optimizer.state:
            return
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)


@dataclass
class TrainState:
    """Where the run stands: the last finished step, the tokens trained on, and
    torch's generator state (CPU, and CUDA when present) of one rank.

    `model_name` (the family, `model.name`) and `model_args` (its shape
    dataclass) are saved too, so that `python -m trainlib.convert dcp-to-hf`
    can rebuild the model from the checkpoint alone; a load compares every
    field with the run's (`Checkpointer.load_from`) and takes the run's.
    `tokens_per_step` is this run's global batch x sequence length and is not
    saved: a resumed run may change it."""

    tokens_per_step: int = 0
    model_args: Any = None
    step: int = 0
    tokens_seen: int = 0
    model_name: str | None = None
    # The settings the learning-rate schedule follows (optimizer.lr, lr_scheduler.*, training.steps): a
    # resume that changes them says so in one line (they take effect from the resumed step on).
    schedule: dict | None = None
    # An MoE model's `[moe]` settings (load balance, capacity, loss weights), by recipe key: a resume that
    # changes them says so in one line too. None for a dense model.
    moe: dict | None = None
    # The model_args fields the run's recipe sets explicitly (model.n_layers, model.vocab_size): a checkpoint
    # whose model differs in those alone loads, and the start-up line names the change. Not saved.
    model_overrides: tuple[str, ...] = ()
    # Keys older checkpoints lack (trainlib.checkpoint.manager asks a load only for those it has).
    optional_keys = ("model_name", "schedule", "moe")

    def advance(self, step: int) -> None:
        self.step = step
        self.tokens_seen += self.tokens_per_step

    def state_dict(self) -> dict[str, Any]:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        sd = {"step": self.step, "tokens_seen": self.tokens_seen, "rng": rng,
              "model_args": asdict(self.model_args) if self.model_args is not None else {}}
        if self.model_name is not None:
            sd["model_name"] = self.model_name
        if self.schedule is not None:
            sd["schedule"] = json.dumps(self.schedule, sort_keys=True)
        if self.moe is not None:
            sd["moe"] = json.dumps(self.moe, sort_keys=True)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        said = not dist.is_initialized() or dist.get_rank() == 0  # every rank loads alike: one line, rank 0's
        changed = _changes(sd.get("schedule"), self.schedule) if said else ""
        if changed:
            logger.warning(f"resumed at step {self.step} with other schedule settings than the checkpoint's run "
                           f"({changed}): the learning rate from step {self.step + 1} on follows the new ones")
        changed = _changes(sd.get("moe"), self.moe) if said else ""
        if changed:
            logger.warning(f"resumed at step {self.step} with other [moe] settings than the checkpoint's run "
                           f"({changed}): they apply from step {self.step + 1} on")
        torch.set_rng_state(sd["rng"]["cpu"])
        if "cuda" in sd["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["rng"]["cuda"])


def _changes(saved: Any, now: dict | None) -> str:
    """`key old -> new, ...` for the settings `now` that differ from `saved` (a JSON string a checkpoint
    recorded); empty when they agree or either side has none."""
    if not isinstance(saved, str) or now is None:
        return ""
    saved = json.loads(saved)
    return ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(set(saved) | set(now))
                     if saved.get(k) != now.get(k))


def nonfinite_entries(states: dict[str, Stateful]) -> list[str]:
    """Keys (`part.key...`) of this rank's floating-point tensors (a shard's
    local part) and floats that hold a NaN or an infinity, in every part."""
    names, tensors, bad = [], [], []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            names.append(prefix)
            tensors.append(value.to_local() if isinstance(value, DTensor) else value)
        elif isinstance(value, float) and not math.isfinite(value):
            bad.append(prefix)

    for key, part in states.items():
        walk(key, part.state_dict())
    if tensors:
        # A sum is NaN or infinite when an element is (and, rarely, when finite values
        # overflow): a fast first pass, one host read for all, confirmed element-wise.
        sums = torch.stack([t.sum(dtype=torch.float32).to(tensors[0].device) for t in tensors]).isfinite().tolist()
        bad += [n for n, t, ok in zip(names, tensors, sums) if not ok and not torch.isfinite(t).all()]
    return bad
