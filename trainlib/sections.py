"""The recipe sections of trainlib's single-module components, torch-free.

Each class is its component's own section (`OptimizerConfig` is trainlib.optim's,
`WatchdogConfig` trainlib.resilience's, ...) and each component re-exports it, so
`from trainlib.optim import OptimizerConfig` works as before. They live here, apart
from the code that uses them, because their modules import torch, and the command
line (`--help`, a misspelled key, a value out of range) is answered before torch
is imported, which takes seconds (docs/architecture.md). Stdlib only: keep it so
(tests/unit/test_cli.py runs `--help` with torch made unimportable).
Packages keep theirs in their own torch-free `config.py` (trainlib.data.config,
trainlib.checkpoint.config, trainlib.parallel.config, trainlib.blocks.config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainlib.data.config import DataConfig
from trainlib.errors import ConfigError
from trainlib.models.roles import PARAM_ROLES


# ----------------------------------------------------------------- trainlib.distributed
@dataclass
class CommConfig:
    # Generous for the first step, which includes compilation and the first
    # all-gathers; strict afterwards, so that a hung rank ends the job with an
    # error instead of holding every GPU forever.
    init_timeout_seconds: float = field(default=600.0, metadata={
        "help": "collective timeout (seconds) from process-group start through the first training step"})
    train_timeout_seconds: float = field(default=300.0, metadata={
        "help": "collective timeout (seconds) after the first step: a hung rank ends the job after this long"})
    backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata={
        "help": "process-group backend; auto = nccl on CUDA, gloo on CPU (nccl needs job.device cuda)"})

    def __post_init__(self) -> None:
        for key in ("init_timeout_seconds", "train_timeout_seconds"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"comm.{key} must be > 0 seconds, got {getattr(self, key)}")


# ----------------------------------------------------------------- trainlib.loss
@dataclass
class LossConfig:
    # The model's forward stops at the final norm and the loss applies the
    # output projection chunk by chunk (see chunked_cross_entropy_sum). False:
    # whole logits, then the cross-entropy (about 3 fp32 [tokens, vocab]
    # tensors at once at the loss).
    chunked: bool = field(default=True, metadata={"help": "apply the output projection and cross-entropy chunk by "
                                                        "chunk, never holding whole [tokens, vocab] logits"})
    # Tokens per chunk; 0 = auto (resolve_chunk_tokens: 256 on CPU, up to
    # 2048 on CUDA). A chunk's transient memory is about 3 fp32
    # [chunk_tokens, vocab / tp] tensors (256 x 128256: 0.4 GB), plus the
    # logits and their gradient in bf16 when the matmuls run in bf16.
    chunk_tokens: int = field(default=0, metadata={"help": "tokens per chunk of the chunked loss; 0 = auto (256 on "
                                                          "CPU, up to 2048 on CUDA)"})

    def __post_init__(self) -> None:
        if self.chunk_tokens < 0:
            raise ConfigError(f"loss.chunk_tokens must be >= 1, or 0 for auto; got {self.chunk_tokens}")


# ----------------------------------------------------------------- trainlib.optim
@dataclass
class MuonConfig:
    """[optimizer.muon]: Muon's keys (trainlib.muon), read only under optimizer.name = "muon"."""

    # Which parameter roles (trainlib.models.roles.PARAM_ROLES, named by the family) Muon updates;
    # every other parameter stays on AdamW with the [optimizer] keys (Moonlight's split by default).
    roles: list[str] = field(default_factory=lambda: ["matrix", "expert", "router"], metadata={
        "help": "parameter roles Muon orthogonalises (of embedding, output, norm, bias, router, expert, matrix); "
                "the rest run AdamW"})
    momentum: float = field(default=0.95, metadata={"help": "momentum of the gradient's running average, in [0, 1)"})
    nesterov: bool = field(default=True, metadata={"help": "orthogonalise the Nesterov look-ahead (gradient "
                                                           "lerped towards the momentum) instead of the momentum"})
    ns_steps: int = field(default=5, metadata={"help": "Newton-Schulz iterations per matrix and step, >= 1"})
    ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315], metadata={
        "help": "the quintic Newton-Schulz coefficients (a, b, c)"})
    eps: float = field(default=1e-7, metadata={"help": "floor of the matrix norm Newton-Schulz divides by; > 0"})
    # match_rms_adamw (Moonlight): lr x 0.2 sqrt(max(A, B)), so AdamW's lr and weight decay carry over;
    # original: lr x sqrt(max(1, A / B)), for a matrix of A rows (out) and B columns (in).
    adjust_lr: Literal["match_rms_adamw", "original"] = field(default="match_rms_adamw", metadata={
        "help": "per-matrix lr scale: match_rms_adamw = 0.2*sqrt(max(A,B)), original = sqrt(max(1,A/B))"})
    ns_dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={
        "help": "dtype Newton-Schulz runs in; auto = bfloat16 on CUDA, float32 on CPU"})
    # MuonClip (Kimi K2): rescale W_q, W_k of every head whose max attention logit exceeded it.
    qk_clip_threshold: float = field(default=0.0, metadata={
        "help": "MuonClip's max attention logit tau: heads whose logits exceeded it get W_q, W_k rescaled after each step "
                "(0 = off; Kimi K2 used 100)"})

    def __post_init__(self) -> None:
        unknown = [r for r in self.roles if r not in PARAM_ROLES]
        if unknown:
            raise ConfigError(f"optimizer.muon.roles has unknown role(s) {unknown}: each must be one of "
                              f"{', '.join(PARAM_ROLES)}; e.g. roles = ['matrix', 'expert', 'router']")
        if self.ns_steps < 1:
            raise ConfigError(f"optimizer.muon.ns_steps must be >= 1 (Newton-Schulz iterations), got {self.ns_steps}"
                              f"; the usual value is 5")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optimizer.muon.momentum must be in [0, 1), got {self.momentum}; e.g. 0.95")
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"optimizer.muon.ns_coefficients must be 3 numbers (a, b, c), got "
                              f"{self.ns_coefficients}; e.g. [3.4445, -4.7750, 2.0315]")
        if not self.eps > 0:
            raise ConfigError(f"optimizer.muon.eps must be > 0, got {self.eps}; e.g. 1e-7")
        if self.qk_clip_threshold < 0:
            raise ConfigError(f"optimizer.muon.qk_clip_threshold (MuonClip's tau) must be > 0, or 0 for off; got "
                              f"{self.qk_clip_threshold}; Kimi K2 used 100")


@dataclass
class OptimizerConfig:
    # A name is an entry of trainlib.optim.OPTIMIZERS (its module declares what it holds and reads).
    name: Literal["adamw", "muon"] = field(default="adamw", metadata={
        "help": "the optimizer: adamw (decoupled weight decay), or muon (orthogonalised updates of the matrices "
                "in optimizer.muon.roles, AdamW with these keys for the rest)"})
    lr: float = field(default=3e-4, metadata={"help": "peak learning rate, reached after warmup; lr_scheduler "
                                                       "scales it"})
    beta1: float = field(default=0.9, metadata={"help": "decay rate of the gradient's running mean (first moment), "
                                                         "in [0, 1)"})
    beta2: float = field(default=0.95, metadata={"help": "decay rate of the squared gradient's running mean (second "
                                                          "moment), in [0, 1)"})
    eps: float = field(default=1e-8, metadata={"help": "added to the second moment's root in the update's "
                                                        "denominator; > 0"})
    weight_decay: float = field(default=0.1, metadata={"help": "decoupled weight decay of matrices (norm gains and "
                                                                "other 1-D parameters get none); 0 = off"})
    # "auto": fused (torch's one-kernel AdamW, for plain tensors and DTensors
    # alike) when every parameter is on CUDA, foreach elsewhere (CPU keeps
    # foreach's numerics); an explicit value is used as given. fused runs on
    # CPU too, and lets the guard withhold an update without a host sync
    # (trainlib.guard).
    # "compiled": trainlib's AdamW (trainlib.adamw), one compiled pass per
    # parameter on CUDA (eager elsewhere) that can keep its moments in bf16
    # and writes the weights' bf16 copies under autocast in the same pass.
    implementation: Literal["auto", "foreach", "fused", "for-loop", "compiled"] = field(default="auto", metadata={
        "help": "AdamW code path; auto = compiled (trainlib's) for bf16 moments or bf16 weight copies, else fused "
                "on CUDA, foreach on CPU"})
    # The moments' dtype. "bfloat16" halves the optimizer state (the update
    # is still computed in fp32) and needs implementation "compiled" or
    # "auto" (which then picks it). Checkpoints record it; a resume refuses a
    # checkpoint of the other dtype.
    state_dtype: Literal["float32", "bfloat16"] = field(default="float32", metadata={
        "help": "dtype of AdamW's moments; bfloat16 halves optimizer state, needs implementation compiled or auto"})
    muon: MuonConfig = field(default_factory=MuonConfig, metadata={
        "help": "Muon's keys (optimizer.name = 'muon' only)"})

    def __post_init__(self) -> None:
        if self.name != "muon" and self.muon != MuonConfig():
            changed = sorted(k for k, v in vars(self.muon).items() if v != getattr(MuonConfig(), k))
            raise ConfigError(f"optimizer.muon.{changed[0]} is set but optimizer.name = '{self.name}': the "
                              f"optimizer.muon keys ({', '.join(changed)}) apply to Muon only; set optimizer.name = "
                              f"'muon' or remove them")
        if self.name == "muon" and (self.implementation != "auto" or self.state_dtype != "float32"):
            raise ConfigError(f"optimizer.name = 'muon' runs its AdamW groups with trainlib's one-pass AdamW in "
                              f"float32, but optimizer.implementation = '{self.implementation}', state_dtype = "
                              f"'{self.state_dtype}'; leave both at their defaults ('auto', 'float32')")
        if self.state_dtype != "float32" and self.implementation not in ("auto", "compiled"):
            raise ConfigError(
                f"optimizer.state_dtype = '{self.state_dtype}' needs optimizer.implementation 'compiled' (or "
                f"'auto'), but it is '{self.implementation}': torch's {self.implementation} AdamW keeps its "
                f"moments in the parameters' dtype; set implementation = 'compiled' or state_dtype = 'float32'")
        if not self.lr > 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if not self.eps > 0:  # eps <= 0 divides by zero (or flips the update's sign) where a moment is zero
            raise ConfigError(f"optimizer.eps must be > 0, got {self.eps}; e.g. 1e-8")


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup from lr / warmup_steps up to lr; "
                                                           "0 = start at the peak"})
    # After warmup: cosine or linear decay to min_lr_ratio * lr over the rest of
    # the run; "wsd" (warmup-stable-decay) holds the peak and decays linearly
    # over the last `decay_ratio` of the steps; "constant" holds the peak.
    decay_type: Literal["cosine", "linear", "wsd", "constant"] = field(default="cosine", metadata={
        "help": "after warmup: cosine/linear decay to the end, wsd = hold then decay linearly, constant = hold"})
    min_lr_ratio: float = field(default=0.1, metadata={
        "help": "final lr as a fraction of optimizer.lr (cosine, linear, wsd), in [0, 1]"})
    decay_ratio: float = field(default=0.2, metadata={
        "help": "wsd only: fraction of the post-warmup steps spent decaying, in (0, 1]"})

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.decay_ratio <= 1:
            raise ConfigError(f"lr_scheduler.decay_ratio must be in (0, 1], got {self.decay_ratio}")


# ----------------------------------------------------------------- trainlib.guard
@dataclass
class GuardConfig:
    """The guard's keys, in the [training] section (`TrainingConfig` extends this)."""

    on_nonfinite: Literal["stop", "skip", "rollback"] = field(
        default="stop", metadata={"help": "a NaN/Inf loss or grad norm: stop (exit 3), skip the update, or roll back "
                                          "to the last checkpoint and move the data past it (docs/reliability.md)"})
    on_spike: Literal["off", "stop", "skip", "rollback"] = field(
        default="off", metadata={"help": "a loss spike (loss > spike_factor x median of the last spike_window good "
                                         "steps): off, or the policy as for on_nonfinite"})
    spike_factor: float = field(default=3.0, metadata={"help": "spike threshold, a multiple of the median loss"})
    spike_window: int = field(default=50, metadata={
        "help": "good steps in the median, and the warm-up before spikes are judged"})
    max_skips: int = field(default=10, metadata={"help": "skips allowed per run; the next event stops the run"})
    max_rollbacks: int = field(default=3, metadata={"help": "rollbacks allowed per run; the next event stops the run"})

    def __post_init__(self) -> None:
        if not self.spike_factor > 1:
            raise ConfigError(f"training.spike_factor must be > 1, got {self.spike_factor}")
        for key in ("spike_window", "max_skips", "max_rollbacks"):
            if getattr(self, key) < (1 if key == "spike_window" else 0):
                raise ConfigError(f"training.{key} must be >= {1 if key == 'spike_window' else 0}, "
                                  f"got {getattr(self, key)}")


# ----------------------------------------------------------------- trainlib.float8
@dataclass
class Float8Config:
    enable: bool = field(default=False, metadata={
        "help": "run the linear layers' matmuls in float8 (torchao; CUDA compute capability >= 8.9 unless emulate)"})
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = field(default="tensorwise", metadata={
        "help": "tensorwise = a scale per tensor (fastest), rowwise = per row, rowwise_with_gw_hp = rowwise "
                "but weight grads not in float8"})
    # fnmatch patterns over module names (e.g. "output", "layers.0.*"); matching
    # linears stay in high precision. Unset: the family's output projection
    # (ModelSpec.output_module), whose error goes straight into the logits and
    # which is one matmul; [] converts it too.
    filter_fqns: list[str] | None = field(default=None, metadata={
        "help": "fnmatch patterns of module names kept in high precision; none = the output projection; "
                "[] = none kept"})
    # torchao 0.18 has float8 grouped GEMMs for MoE experts (its prototype
    # moe_training, Float8TrainingOpConfig: rowwise, CUDA sm90+, bf16); trainlib
    # does not wire them yet (trainlib.config.validate refuses the key).
    moe_experts: bool = field(default=False, metadata={
        "help": "also run MoE blocks' routed experts in float8 (torchao's grouped GEMMs, CUDA only; not built "
                "yet: refused)"})
    # Emulate float8 matmuls in high precision (casts still round to float8):
    # for testing on hardware without float8 matmuls.
    emulate: bool = field(default=False, metadata={
        "help": "emulate float8 matmuls in high precision (casts still round): tests numerics anywhere, no speed-up"})
    # tensorwise + FSDP: all-gather weights in float8 and precompute their
    # scales after each optimizer step. Ignored by the rowwise recipes.
    fsdp_float8_all_gather: bool = field(default=True, metadata={
        "help": "tensorwise + FSDP: all-gather weights in float8 (half the bytes); ignored by rowwise recipes"})
    # Linears whose size 2*in*out/(in+out) (the harmonic mean of their in and
    # out features) is below this stay in high precision. Per token, float8
    # halves a linear's matmul time, which grows as in*out, and adds casts of
    # its input and output gradient, which grow as in+out: small or skinny
    # linears lose. None: the recipe's bound, MIN_SIZE; 0: every linear with
    # dims multiple of 16 (the behaviour before this key).
    min_size: int | None = field(default=None, metadata={
        "help": "linears with 2*in*out/(in+out) below this stay high precision; none = the recipe's bound; "
                "0 = convert all"})

    def __post_init__(self) -> None:
        if self.min_size is not None and self.min_size < 0:
            raise ConfigError(f"float8.min_size must be >= 0 (or unset for the recipe's bound), got {self.min_size}")


# ----------------------------------------------------------------- trainlib.metrics
@dataclass
class MetricsConfig:
    log_freq: int = field(default=10, metadata={"help": "steps between metric records (file, console, backends); "
                                                      "step 1 and the last step are always logged"})
    # A line per log step on rank 0. Off only for programs that print their own.
    console: bool = field(default=True, metadata={"help": "print a line per logged step on rank 0; false for programs "
                                                        "that print their own"})
    enable_tensorboard: bool = field(default=False, metadata={
        "help": "also write every numeric metric to TensorBoard event files in the run folder's save_tb_folder "
                "(needs the extra: pip install 'trainlib[tensorboard]')"})
    save_tb_folder: str = field(default="tb", metadata={"help": "TensorBoard folder, inside the run folder"})
    enable_wandb: bool = field(default=False, metadata={
        "help": "also log every numeric metric to Weights & Biases; its files go to the run folder's wandb/ "
                "(needs the extra: pip install 'trainlib[wandb]')"})
    wandb_project: str = field(default="trainlib", metadata={"help": "W&B project the run is logged to (enable_wandb)"})
    wandb_entity: str | None = field(default=None, metadata={"help": "W&B team or user; unset: your default"})
    wandb_mode: Literal["online", "offline"] | None = field(default=None, metadata={
        "help": "W&B mode; offline writes only local files (`wandb sync` uploads them later). "
                "The WANDB_MODE environment variable, when set, wins; unset both: online"})

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ConfigError(f"metrics.log_freq must be >= 1, got {self.log_freq}")


# ----------------------------------------------------------------- trainlib.validation
@dataclass
class ValidationConfig:
    enable: bool = field(default=False, metadata={"help": "compute loss and perplexity on held-out data every "
                                                          "interval steps and at the last step"})
    interval: int = field(default=100, metadata={"help": "steps between validations (and always at the last step)"})
    steps: int = field(default=10, metadata={"help": "global batches per validation (training.global_batch_size "
                                                     "sequences each)"})
    data: DataConfig = field(default_factory=DataConfig, metadata={
        "help": "the validation data, keys as in [data]; unset path, hf_dataset and mixture = the shipped "
                "corpus's held-out chapters (never trained on)"})

    def __post_init__(self) -> None:
        for key in ("interval", "steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"validation.{key} must be >= 1, got {getattr(self, key)}")


# ----------------------------------------------------------------- trainlib.profiling
@dataclass
class ProfilingConfig:
    enable_profiling: bool = field(default=False, metadata={"help": "trace a window of steps with torch.profiler"})
    save_traces_folder: str = field(default="profile_traces", metadata={"help": "traces folder, in the run folder"})
    profile_freq: int = field(default=100, metadata={"help": "a traced window ends every profile_freq steps"})
    profile_warmup: int = field(default=3, metadata={"help": "steps profiled but not kept before each window"})
    profile_active: int = field(default=1, metadata={"help": "steps recorded per window"})
    profile_windows: int = field(default=0, metadata={"help": "windows to trace; 0 = every profile_freq steps"})
    enable_memory_snapshot: bool = field(default=False, metadata={
        "help": "CUDA only: record the allocator's history, dump it after memory_snapshot_step and on OOM"})
    save_memory_snapshot_folder: str = field(default="memory_snapshot", metadata={
        "help": "memory snapshots folder, in the run folder"})
    memory_snapshot_step: int = field(default=2, metadata={"help": "the step after which the snapshot is dumped"})

    def __post_init__(self) -> None:
        for key, low in (("profile_freq", 1), ("profile_warmup", 0), ("profile_active", 1), ("profile_windows", 0),
                         ("memory_snapshot_step", 1)):
            if getattr(self, key) < low:
                raise ConfigError(f"profiling.{key} must be >= {low}, got {getattr(self, key)}")
        if self.profile_warmup + self.profile_active > self.profile_freq:
            raise ConfigError(
                f"profiling.profile_warmup ({self.profile_warmup}) + profile_active ({self.profile_active}) must "
                f"fit in profile_freq ({self.profile_freq}) steps; raise profile_freq or shorten the window")


# ----------------------------------------------------------------- trainlib.resilience
@dataclass
class WatchdogConfig:
    enable: bool = field(default=True, metadata={"help": "detect a hung step; stacks of every rank go to <dump_folder>/hang/"})
    step_factor: float = field(default=10.0, metadata={
        "help": "a step is hung after step_factor x the median of the last 100 step times (and min_seconds)"})
    min_seconds: float = field(default=30.0, metadata={
        "help": "never call a step hung before this; must be below comm.train_timeout_seconds / 2"})

    def __post_init__(self) -> None:
        if not self.step_factor > 1:
            raise ConfigError(f"watchdog.step_factor must be > 1 (a multiple of the median step time), got {self.step_factor}")
        if not self.min_seconds > 0:
            raise ConfigError(f"watchdog.min_seconds must be > 0, got {self.min_seconds}")



# ----------------------------------------------------------------- trainlib.parallel.replica
@dataclass
class FaultToleranceConfig:
    """In-place fault tolerance on torchft (docs/reliability.md, "Replica groups"). Each replica group is its own
    torchrun job with its own world (FSDP/TP/PP/CP/EP inside it as usual); the groups average gradients through
    torchft's managed process group, a dead group is dropped at the next quorum and a relaunched one heals from a
    live peer. Timeouts, shortest first: connect < process_group < quorum, and quorum + process_group below
    comm.train_timeout_seconds and watchdog.min_seconds (the lighthouse's heartbeat timeout, set where it is
    started, below quorum_timeout_seconds)."""

    enable: bool = field(default=False, metadata={
        "help": "train as one of several replica groups on torchft (pip install 'trainlib[ft]')"})
    replica_groups: int = field(default=1, metadata={
        "help": "how many replica groups the job has (each reads its own slice of the global batch); >= 2"})
    replica_id: int = field(default=0, metadata={"help": "this group's index, 0 .. replica_groups - 1"})
    min_replica_size: int = field(default=1, metadata={
        "help": "fewest live groups a step commits with; below it the step is run again after the next quorum"})
    lighthouse: str = field(default="", metadata={
        "help": "the lighthouse's address (http://host:port); empty: the TORCHFT_LIGHTHOUSE environment variable"})
    connect_timeout_seconds: float = field(default=10.0, metadata={
        "help": "connecting to the lighthouse and to the group managers; an unreachable lighthouse is refused "
                "after it"})
    process_group_timeout_seconds: float = field(default=10.0, metadata={
        "help": "a cross-group collective, should_commit and a heal's state transfer: a peer that stops "
                "responding fails the step after this long (the step is run again without it)"})
    quorum_timeout_seconds: float = field(default=15.0, metadata={
        "help": "how long a step waits for the lighthouse's quorum (must exceed the lighthouse's heartbeat timeout)"})

    def __post_init__(self) -> None:
        for key in ("connect_timeout_seconds", "process_group_timeout_seconds", "quorum_timeout_seconds"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"fault_tolerance.{key} must be > 0 seconds, got {getattr(self, key)}")
        if self.min_replica_size < 1:
            raise ConfigError(f"fault_tolerance.min_replica_size must be >= 1, got {self.min_replica_size}")
        if not self.enable:
            return
        if self.replica_groups < 2:
            raise ConfigError(
                f"fault_tolerance.enable needs a replica dimension: replica_groups = {self.replica_groups}, but a "
                f"group can only fail over to another; set fault_tolerance.replica_groups >= 2 (one torchrun job "
                f"per group, python -m trainlib.ft local), or turn fault_tolerance.enable off")
        if not 0 <= self.replica_id < self.replica_groups:
            raise ConfigError(
                f"fault_tolerance.replica_id = {self.replica_id} is outside the {self.replica_groups} replica groups; "
                f"give each group's job its index 0 .. {self.replica_groups - 1}")
        if self.min_replica_size > self.replica_groups:
            raise ConfigError(
                f"fault_tolerance.min_replica_size ({self.min_replica_size}) exceeds replica_groups "
                f"({self.replica_groups}): no step could commit; set it to at most {self.replica_groups}")
        if not self.connect_timeout_seconds <= self.process_group_timeout_seconds < self.quorum_timeout_seconds:
            raise ConfigError(
                f"fault_tolerance timeouts must grow connect ({self.connect_timeout_seconds}) <= process_group "
                f"({self.process_group_timeout_seconds}) < quorum ({self.quorum_timeout_seconds}) seconds: a step "
                f"waiting for a quorum must outlast a failed cross-group collective, which outlasts a connection "
                f"attempt; raise the later ones or lower the earlier ones")
