"""float8 x torch.compile x activation checkpointing on one GPU, in-process,
at the block level: the gradients of every combination against eager bf16.

Issue 11 measured, on one H100 (torch 2.11, torchao 0.17), a NaN loss with
float8 rowwise + compile + selective_op `every_other_mm` (grad norm 3287 at
step 1 against 41 in bf16); the same recipe was finite eagerly and with the
other AC modes. A wrong gradient shows at the first backward, so one
forward+backward per combination finds it without a training run. The cause
was inductor's rounding in the recompute (trainlib.float8.
round_like_eager_under_compile, the fix the trainer applies); that combination
also runs without the fix, as a strict xfail: the fault, reproduced on one
H200 (grad norm 20.3 against 2.39 in bf16; with the fix 2.3858, eager's
value). The day it passes, this test no longer sees the fault.

`python -m pytest -m gpu tests/gpu/test_float8_ac_compile.py` (about 30 graphs
to compile). The shape is the measured one (Llama 3.1 8B blocks), cut to 2
blocks, seq 4096, so it runs in a few minutes.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import needs_cuda, needs_float8_gpu
from trainlib.float8 import RECIPES, Float8Config, convert_float8, round_like_eager_under_compile
from trainlib.models.llama3.model import Transformer, get_model_args
from trainlib.parallel.ac import apply_ac
from trainlib.parallel.compile import apply_compile

pytestmark = [pytest.mark.gpu, needs_cuda, needs_float8_gpu]

SEQ = 4096
AC_MODES = [("none", "all_mm"), ("full", "all_mm"), ("selective_layer", "all_mm"), ("selective_op", "all_mm"),
            ("selective_op", "every_other_mm")]
# float8 against bf16, first backward of a freshly initialised model: casts to
# e4m3/e5m2 move the grad norm by a few percent at most; the measured fault
# moved it 80x. Loss: float8's rounding of activations, well under 1%.
GRAD_NORM_RTOL, LOSS_RTOL = 0.1, 1e-2


def grads(device, recipe: str | None, ac_mode: str, policy: str, compiled: bool, *, n_layers: int = 2,
          seq: int = SEQ, flavor: str = "llama3.1_8b", backend: str = "inductor",
          round_like_eager: bool = True) -> tuple[float, float, dict]:
    """(loss, grad norm, {name: grad}) of one forward+backward, bf16 parameters
    (as FSDP's mixed precision gives them), float8 `recipe` (None: bf16).
    `backend` "aot_eager" or "eager" tells a partitioner fault from a codegen one.
    `round_like_eager=False` leaves out the trainer's inductor rounding setting
    (trainlib.float8.round_like_eager_under_compile), to show what it fixes."""
    torch._dynamo.reset()
    args = get_model_args(flavor, n_layers=n_layers, vocab_size=512)
    model = Transformer(args, rope_len=seq).to(device)
    model.init_weights(seed=0)
    cfg = Float8Config(enable=recipe is not None, recipe=recipe or "tensorwise", min_size=0)
    if recipe:
        convert_float8(model, cfg, fsdp=False, output_module="output")
    apply_ac(model, ac_mode, selective_op_policy=policy)
    if compiled:
        apply_compile(model, backend=backend)
    model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (1, seq + 1), generator=g).to(device)
    # The setting is process-wide and read when a graph compiles (here, at the first call): scoped to this run.
    with torch._inductor.config.patch(emulate_precision_casts=False):
        if round_like_eager:
            round_like_eager_under_compile(cfg, compiled)
        loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    named = {n: p.grad.float() for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in named.values()]))
    return loss.item(), norm.item(), named


@pytest.fixture(scope="module")
def bf16_reference():
    return grads("cuda", None, "none", "all_mm", False)


def _combos():
    """(recipe, ac_mode, policy, compiled, round_like_eager) of every combination
    as the trainer runs it, and the measured fault: rowwise under compile with
    every_other_mm without the rounding fix, expected to fail (strict: if it
    passes, this test does not reproduce the fault). rowwise_with_gw_hp without
    the fix passed on the H200 (grad norm 2.3877 against 2.3892), so it has no
    such twin."""
    for recipe in RECIPES:
        for ac_mode, policy in AC_MODES:
            for compiled in (False, True):
                name = f"{recipe}-{ac_mode}-{policy}-{'compile' if compiled else 'eager'}"
                yield pytest.param(recipe, ac_mode, policy, compiled, True, id=name)
                if recipe == "rowwise" and compiled and policy == "every_other_mm":
                    yield pytest.param(recipe, ac_mode, policy, compiled, False, id=f"{name}-unrounded", marks=[
                        pytest.mark.xfail(strict=True, reason="the fault measured on one H100 and one H200, "
                                                              "without the fix")])


@pytest.mark.parametrize("recipe,ac_mode,policy,compiled,round_like_eager", list(_combos()))
def test_float8_gradients_finite_and_close_to_bf16(bf16_reference, recipe, ac_mode, policy, compiled,
                                                   round_like_eager):
    ref_loss, ref_norm, _ = bf16_reference
    loss, norm, named = grads("cuda", recipe, ac_mode, policy, compiled, round_like_eager=round_like_eager)
    bad = [n for n, x in named.items() if not torch.isfinite(x).all()]
    print(f"{recipe} {ac_mode} {policy} compile={compiled} round_like_eager={round_like_eager}: loss {loss:.5f} "
          f"(bf16 {ref_loss:.5f}), grad norm {norm:.4f} (bf16 {ref_norm:.4f})")
    assert not bad and math.isfinite(loss), f"non-finite gradients in {bad[:4]}"
    assert abs(loss - ref_loss) <= LOSS_RTOL * ref_loss
    assert abs(norm - ref_norm) <= GRAD_NORM_RTOL * ref_norm, f"grad norm {norm} vs bf16 {ref_norm}"
