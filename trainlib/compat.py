"""What trainlib does differently by torch version, in one place.

Each flag names a behaviour of the installed torch that trainlib branches on,
with the fault or change behind it and where it was measured. The modules that
branch read the flag here (`compat.NAME`), so a test can switch one with
`monkeypatch.setattr(compat, NAME, ...)`. Messages that name the installed
version print `torch.__version__` themselves.
"""

from __future__ import annotations

import torch

_TORCH = torch.torch_version.TorchVersion(torch.__version__)

# Pipelining (trainlib.parallel.pp, config.validate). Before torch 2.13 a
# schedule's first step sends every stage's neighbours a tensor, also when both
# stages are on one rank (the V placements); gloo cannot send to its own rank
# ("Pair is not connected", measured on torch 2.11). torch 2.13 warms up
# without those sends. NCCL sends to itself.
V_SCHEDULES_ON_GLOO = _TORCH >= "2.13"
# Before torch 2.13 the zero-bubble schedules' input-gradient pass reads
# `_input_metadata` of every autograd node and fails on a custom
# autograd.Function's node, such as the chunked loss's (measured on torch 2.11:
# "Attribute '_input_metadata' is invalid"). torch 2.13 handles them.
ZERO_BUBBLE_WITH_CHUNKED_LOSS = _TORCH >= "2.13"

# float8 (trainlib.float8, config.validate). torch 2.11's CPU torch._scaled_mm
# takes one scale per tensor only (an internal assert at the first rowwise
# matmul, measured); 2.13's takes row scales. A rule of the machine, not of the
# build: the planner builds every job on the CPU.
CPU_ROWWISE_MATMULS = _TORCH >= "2.13"

# Checkpoints (trainlib.checkpoint.manager). torch 2.11's DefaultStager empties
# its deep-copy table at the end of every stage, so its second save fails
# (KeyError: <class 'type'>, measured); 2.13's keeps it, and with it the pinned
# buffers a reused stager copies into.
STAGER_REUSABLE = _TORCH >= "2.13"

# The planner's communication model (trainlib.plan.comm). From torch 2.15 FSDP
# has autograd make each unsharded gradient in reduce_dtype and resolves the
# pending sums TP leaves on the sequence-parallel norms' gradients when it
# reduces the gradient; before, it resolved them in the compute dtype in every
# micro-batch's post-backward.
FSDP_GRADS_IN_REDUCE_DTYPE = _TORCH >= "2.15"
