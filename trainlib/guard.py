"""The non-finite and spike guard: every step is judged before its update.

Rules (the same verdict on every rank: the loss is the global loss, all-reduced
over every rank that holds tokens and over the pipeline; the grad norm is global
already):

  non-finite  the step's loss or grad norm is NaN or +-Inf.
  spike       (`training.on_spike` != "off") the loss is above `spike_factor` x
              the median of the losses of the last `spike_window` good steps
              (the lower middle value for an even window), once `spike_window`
              good steps have been seen since the run began (warm-up). A good
              step is one with no event; skipped and rolled-back steps do not
              enter the window. The window is saved in checkpoints.

Policies, `training.on_nonfinite` (default stop) and `training.on_spike`:

  stop      the run exits with code 3 and one line naming the step and what was
            wrong; no checkpoint is written after the event.
  skip      the step's update is withheld (the optimizer state is untouched:
            moments, weight decay, step count); its data is consumed, and the
            step number and the LR schedule advance as for any step.
  rollback  the last complete checkpoint is reloaded (model, optimizer, LR
            schedule, step, tokens seen), not the data loader: the data goes on
            from where it is, past every batch since that checkpoint (the
            offending window). Training continues at the checkpoint's step + 1.

Budget: `training.max_skips` skips and `training.max_rollbacks` rollbacks per
run, counted across resumes (saved in checkpoints). An event that finds its
budget spent stops the run as `stop` does.

When the host learns of an event. `check` judges a step on the device and
costs no host sync. `settle` reads every step judged since the last settle in
one transfer; the loop calls it where it reads values anyway (log steps), before
every checkpoint save, and at the run's end, and then applies the policies in
step order. The update of a bad step is withheld
  - on the device, with no sync, under fused AdamW (`optimizer.implementation =
    fused`): the guard sets the optimizer's `found_inf`, which torch's fused
    kernel reads to skip the whole update and undo the step count (as
    GradScaler does);
  - by the host under foreach/for-loop AdamW when a policy is `skip`: those
    implementations have no such input, so the verdict is read before every
    update (one host sync per step).
Otherwise (stop or rollback under foreach/for-loop) the bad update runs; the run
stops or rolls back at the next settle, which precedes any save, so that state
is never written.

metrics.jsonl: every event step gets a record, whatever `metrics.log_freq`,
with `event` ("nonfinite" | "spike"), `action` ("skip" | "rollback" | "stop"),
the running `skips` and `rollbacks`, `spike_threshold` for spikes and
`rollback_to_step` for rollbacks. A non-finite value is written as null and
named with its value in `nonfinite` (see trainlib.metrics).
"""

from __future__ import annotations

import json
import logging
import math

import torch

from trainlib.errors import TrainingStopped
from trainlib.sections import GuardConfig
from trainlib.optim import fused_on

logger = logging.getLogger("trainlib")

NONFINITE, SPIKE = 1.0, 2.0  # verdicts; 0 is a good step


class Guard:
    """Judges each step (`check`), acts on the verdicts (`settle`). A `Stateful`:
    checkpoints hold its budget counts and spike window (key `guard`)."""

    def __init__(self, cfg: GuardConfig, optimizer: torch.optim.Optimizer, device: torch.device):
        self.cfg, self.optimizer = cfg, optimizer
        # Fused AdamW reads `found_inf` where the parameters live; with them offloaded
        # to the CPU that would be an unsynchronised copy from the GPU: gate on the host.
        self.device_gate = fused_on(optimizer, device)
        self.host_gate = not self.device_gate and "skip" in (cfg.on_nonfinite, cfg.on_spike)
        self.window = torch.full((cfg.spike_window,), math.nan, device=device)  # ring of good losses
        self.n_good = torch.zeros((), dtype=torch.long, device=device)
        self.skips = self.rollbacks = 0
        self.event_known = False  # the host has read an event that is not settled yet
        # whether the last checked step's update is withheld: True/False on the host, a bool tensor on the device
        self.withheld: bool | torch.Tensor = False
        self._pending: list[tuple[int, float, torch.Tensor]] = []  # (step, lr, [loss, grad_norm, verdict, threshold])

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Judge step `step` from its global loss and grad norm, and gate its
        update. Returns False when the caller must not run the update."""
        loss, grad_norm = loss.detach().float(), grad_norm.detach().float().to(loss.device)
        nonfinite = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        verdict, threshold = nonfinite.float() * NONFINITE, torch.full_like(loss, math.nan)
        if self.cfg.on_spike != "off":
            threshold = self.cfg.spike_factor * torch.nanmedian(self.window)
            spike = (self.n_good >= self.cfg.spike_window) & (loss > threshold) & ~nonfinite
            verdict = verdict + spike.float() * SPIKE
            good = verdict == 0
            slot = (self.n_good % self.cfg.spike_window).reshape(1)
            self.window.index_put_((slot,), torch.where(good, loss, self.window.index_select(0, slot)))
            self.n_good += good.long()
        packed = torch.stack([loss, grad_norm, verdict, threshold])
        self._pending.append((step, self.optimizer.param_groups[0]["lr"], packed))
        self.withheld = False
        if self.device_gate:
            self.withheld = verdict != 0
            self.optimizer.found_inf = self.withheld.float()
        elif self.host_gate and verdict.item() != 0:  # this path's one host sync per step
            self.event_known = self.withheld = True
            return False
        return True

    def settle(self, step: int, log: bool, metrics, checkpointer, at_step: dict | None = None,
               **extra) -> tuple[list[dict], int | None]:
        """Read the steps judged since the last settle (one host transfer) and
        apply the policies in step order. Logs each event step, and step `step`
        when `log`; `extra` fields go into every record, `at_step` fields (validation's) only into step `step`'s.
        Returns (the records logged, the step to continue after when it rolled back, else None). Raises
        TrainingStopped to stop the run."""
        pending, self._pending, self.event_known = self._pending, [], False
        values = torch.stack([p for _, _, p in pending]).tolist()
        records = []
        for (s, lr, _), (loss, grad_norm, verdict, threshold) in zip(pending, values):
            own = {**extra, **(at_step or {})} if s == step else extra
            if verdict == 0:
                if s == step and log:
                    records.append(metrics.log(s, loss=loss, grad_norm=grad_norm, lr=lr, **own))
                continue
            kind = "nonfinite" if verdict == NONFINITE else "spike"
            policy = self.cfg.on_nonfinite if kind == "nonfinite" else self.cfg.on_spike
            what = (", ".join(f"{k} is {v}" for k, v in (("loss", loss), ("grad_norm", grad_norm))
                              if not math.isfinite(v)) if kind == "nonfinite" else
                    f"loss {loss:.4g} is a spike (above {self.cfg.spike_factor:g} x the median of the last "
                    f"{self.cfg.spike_window} good steps = {threshold:.4g})")
            reason, to = f"training.on_{kind} = {policy}", None
            if policy != "stop" and getattr(self, f"{policy}s") >= getattr(self.cfg, f"max_{policy}s"):
                policy, reason = "stop", f"training.max_{policy}s = {getattr(self.cfg, f'max_{policy}s')} spent"
            if policy == "rollback":
                to = checkpointer.restore_latest(exclude=("dataloader", "guard"))
                if to is None:
                    policy, reason = "stop", f"{reason}, but there is no complete checkpoint yet"
            self.skips += policy == "skip"
            self.rollbacks += policy == "rollback"
            fields = {"event": kind, "action": policy, "skips": self.skips, "rollbacks": self.rollbacks}
            if kind == "spike":
                fields["spike_threshold"] = threshold
            if to is not None:
                fields["rollback_to_step"] = to
            records.append(metrics.log(s, loss=loss, grad_norm=grad_norm, lr=lr, **fields, **own))
            if policy == "stop":
                raise TrainingStopped(f"step {s}: {what} ({reason})")
            if policy == "rollback":
                logger.warning(f"step {s}: {what}: rolled back to the checkpoint of step {to}; the data goes on "
                               f"after step {step}'s batch ({self.rollbacks} of {self.cfg.max_rollbacks} rollbacks)")
                return records, to  # later steps of this window are undone with it
            logger.warning(f"step {s}: {what}: update skipped ({self.skips} of {self.cfg.max_skips} skips)")
        return records, None

    # ---- Stateful (checkpoint key `guard`) ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        # One JSON string: a checkpoint then loads whatever the spike_window it was saved with.
        n, ring = int(self.n_good), self.window.tolist()
        good = [ring[(n - k) % len(ring)] for k in range(min(n, len(ring)), 0, -1)]  # oldest first
        return {"state": json.dumps({"skips": self.skips, "rollbacks": self.rollbacks, "good_steps": n,
                                     "last_good_losses": good})}

    def load_state_dict(self, sd: dict) -> None:
        state = json.loads(sd["state"])
        self.skips, self.rollbacks = state["skips"], state["rollbacks"]
        good = state["last_good_losses"][-self.cfg.spike_window:]
        self.window.fill_(math.nan)
        self.window[: len(good)] = torch.tensor(good, dtype=self.window.dtype)
        # Slot order restarts at 0; a shorter history than the window (a larger spike_window) warms up again.
        self.n_good.fill_(len(good) if len(good) < self.cfg.spike_window else state["good_steps"])
        if len(good) == self.cfg.spike_window:
            self.window.copy_(self.window.roll(state["good_steps"] % self.cfg.spike_window))
