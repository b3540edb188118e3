"""Gradient clipping on DTensor gradients, pending-sum (Partial) and whole ones of sharded parameters included.

TP leaves the weights of sequence-parallel norms with Partial("sum")
gradients where no FSDP reduces them (tp alone, pp x tp). torch 2.11's
`_foreach_mul_` leaves a Partial DTensor unchanged, so `clip_grads_with_norm_`
did not clip those gradients and TP+SP drifted from one process there.
"""

import math

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tests.helpers import spawn
from trainlib.parallel import clip_grad_norm_


def _param(mesh, full_grad, placements, local_grad, param_placements=None):
    """A parameter whose gradient is `local_grad` with `placements`; the parameter's placements are those
    with pending sums summed (the parameter of a pending-sum gradient is replicated), unless given."""
    param_placements = param_placements or [Replicate() if pl.is_partial() else pl for pl in placements]
    p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(full_grad), mesh, param_placements))
    p.grad = DTensor.from_local(local_grad, mesh, placements, run_check=False,
                                shape=full_grad.shape, stride=full_grad.stride())
    return p


def _check_clip(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    _check_clip_on(mesh, 1.0)  # the norm is ~8: clipping scales by ~1/8
    _check_clip_on(mesh, 0.0)  # measuring only: pending gradients are still summed


def _check_clip_on(mesh, max_norm):
    a, b = mesh["a"].get_local_rank(), mesh["b"].get_local_rank()
    gen = torch.Generator().manual_seed(0)
    full, params = [], []
    # A norm weight's gradient under TP+SP: replicated on a, pending sum over b.
    parts = [torch.randn(6, generator=gen) for _ in range(2)]
    full.append(parts[0] + parts[1])
    params.append(_param(mesh, full[-1], [Replicate(), Partial()], parts[b].clone()))
    # Sharded over a (5 rows: uneven) and pending sum over b.
    parts = [torch.randn(5, 3, generator=gen) for _ in range(2)]
    full.append(parts[0] + parts[1])
    params.append(_param(mesh, full[-1], [Shard(0), Partial()], parts[b][:3].clone() if a == 0
                         else parts[b][3:].clone()))
    # Pending sums over both dimensions.
    parts = [[torch.randn(4, generator=gen) for _ in range(2)] for _ in range(2)]
    full.append(sum(parts[i][j] for i in range(2) for j in range(2)))
    params.append(_param(mesh, full[-1], [Partial(), Partial()], parts[a][b].clone()))
    # A pending average (not sum) over b: left to DTensor's own redistribute.
    parts = [torch.randn(2, 3, generator=gen) for _ in range(2)]
    full.append((parts[0] + parts[1]) / 2)
    params.append(_param(mesh, full[-1], [Replicate(), Partial("avg")], parts[b].clone()))
    # Already final: replicated.
    full.append(torch.randn(3, 2, generator=gen))
    params.append(_param(mesh, full[-1], [Replicate(), Replicate()], full[-1].clone()))
    # TP's embedding without FSDP: the gradient whole where the parameter's rows are sharded over b.
    full.append(torch.randn(5, 2, generator=gen))
    params.append(_param(mesh, full[-1], [Replicate(), Replicate()], full[-1].clone(), [Replicate(), Shard(0)]))

    norm = clip_grad_norm_(params, max_norm)
    want = math.sqrt(sum(float((g * g).sum()) for g in full))
    assert not isinstance(norm, DTensor)
    assert abs(float(norm) - want) < 1e-5 * want, (float(norm), want)
    coef = min(1.0, max_norm / (want + 1e-6)) if max_norm > 0 else 1.0
    for i, (p, g) in enumerate(zip(params, full)):
        assert p.grad.placements == p.placements, (i, p.grad.placements)  # no pending sum, no whole shard
        assert p.grad.shape == p.shape and p.grad.stride() == p.stride(), (i, p.grad.stride())
        torch.testing.assert_close(p.grad.full_tensor(), g * coef, rtol=1e-6, atol=1e-7, msg=f"gradient {i}")
    # The embedding's shard is its own tensor: the whole gradient is freed, not kept under a view.
    shard = params[-1].grad.to_local()
    assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size() < full[-1].nbytes


def test_clip_scales_pending_sum_gradients_and_leaves_none_pending():
    spawn(_check_clip, 4)


def _check_clip_over_stages(rank, world):
    """Each pipeline stage holds different layers: the norm sums the squares
    of every stage's gradients, and every stage scales by that one norm."""
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    stage = pp_mesh.get_local_rank()
    grads = [torch.full((3,), 3.0 * (stage + 1)), torch.full((2, 2), -1.0 - stage)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    params.append(torch.nn.Parameter(torch.zeros(4)))  # no gradient (frozen or unused here): skipped
    want = math.sqrt(3 * 9 + 4 * 1 + 3 * 36 + 4 * 4)
    norm = clip_grad_norm_(iter(params), 1.0, pp_mesh=pp_mesh)  # any iterable, read once
    assert abs(float(norm) - want) < 1e-6 * want, (float(norm), want)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g / (want + 1e-6))
    assert params[-1].grad is None
    # A stage with no gradients at all still joins the sum.
    mine = [torch.nn.Parameter(torch.zeros(2))] if stage == 0 else []
    for p in mine:
        p.grad = torch.tensor([3.0, 4.0])
    assert float(clip_grad_norm_(mine, 0.0, pp_mesh=pp_mesh)) == 5.0


def test_clip_norm_spans_pipeline_stages():
    spawn(_check_clip_over_stages, 2)


def _clip_then_step(make_params, max_norm, implementation):
    """Two copies of the same parameters and gradients under AdamW's
    `implementation` ("fused" or "foreach"): one clipped here, one whose
    optimizer is passed to the clip (the hand-over happens under fused only).
    Returns (params, grads) of both after the step, and the handed-over
    copy's gradients and `grad_scale` as they were between clip and step."""
    out = []
    for hand_over in (False, True):
        params = make_params()
        opt = torch.optim.AdamW(params, lr=0.1, **{implementation: True})
        norm = clip_grad_norm_(params, max_norm, optimizer=opt if hand_over else None)
        between = ([p.grad.clone() for p in params], getattr(opt, "grad_scale", "unset"), norm)
        opt.step()
        out.append(([p.detach().clone() for p in params], [p.grad for p in params], between))
    return out


def _check_clip_in_fused_step(rank, world):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))

    def make(sharded):
        gen = torch.Generator().manual_seed(1)
        params = []
        for shape in [(4, 3), (6,), (5, 2)]:  # 5 rows: uneven shards
            w, g = torch.randn(shape, generator=gen), 4 * torch.randn(shape, generator=gen)
            if sharded:
                w, g = (distribute_tensor(t, mesh, [Shard(0)]) for t in (w, g))
            p = torch.nn.Parameter(w)
            p.grad = g
            params.append(p)
        return params

    for sharded in (False, True):
        grads0 = [p.grad.full_tensor() if sharded else p.grad for p in make(sharded)]
        want = math.sqrt(sum(float((g * g).sum()) for g in grads0))  # ~20
        for max_norm in (1.0, 1e3, 0.0):  # clipping, under the norm, measuring only
            (p_here, g_here, _), (p_step, g_step, (g_between, scale, norm)) = _clip_then_step(
                lambda: make(sharded), max_norm, "fused")
            clips = 0 < max_norm < want
            # Handed over: nothing scaled before the step; the step gets 1 / clip factor (1 when under the norm).
            for g, g0 in zip(g_between, grads0):
                torch.testing.assert_close(g.full_tensor() if sharded else g, g0, rtol=0, atol=0)
            if max_norm > 0:
                assert abs(float(scale) - max(1.0, (want + 1e-6) / max_norm)) < 1e-5 * want, (float(scale), want)
            else:
                assert scale is None
            assert abs(float(norm) - want) < 1e-5 * want
            # After the step both copies hold the same parameters and the same (clipped) gradients.
            for a, b in zip(p_here + g_here, p_step + g_step):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
            assert clips == (max_norm == 1.0)
        # Under foreach the clip stays here: no grad_scale is set.
        (_, _, _), (_, _, (g_between, scale, _)) = _clip_then_step(lambda: make(sharded), 1.0, "foreach")
        assert scale == "unset"
        full = [g.full_tensor() if sharded else g for g in g_between]
        torch.testing.assert_close(full[0], grads0[0] / (want + 1e-6))


def test_clip_is_handed_to_a_fused_adamw_step_with_the_same_result():
    spawn(_check_clip_in_fused_step, 2)


def _check_clip_over_two_meshes(rank, world):
    from trainlib.parallel import ParallelDims

    # The dense view's dp_shard and the experts' ep: the same two ranks, two meshes (parameters of an MoE
    # model live on both), plus a plain tensor.
    dims = ParallelDims(world_size=2, dp_shard=2, ep=2)
    dims.build_mesh("cpu")
    dense, experts = dims.mesh("dp_shard"), dims.mesh("ep")
    assert dense is not experts
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 3, generator=gen), torch.randn(4, 5, generator=gen), torch.randn(7, generator=gen)]
    params = [_param(dense, full[0], [Shard(0)], full[0].chunk(2)[rank].clone()),
              _param(experts, full[1], [Shard(0)], full[1].chunk(2)[rank].clone())]
    plain = torch.nn.Parameter(torch.zeros(7))
    plain.grad = full[2].clone()
    expected = torch.cat([f.flatten() for f in full]).norm()
    norm = clip_grad_norm_([*params, plain], max_norm=1.0)
    assert not isinstance(norm, DTensor) and math.isclose(norm.item(), expected.item(), rel_tol=1e-6), (norm, expected)
    scale = 1.0 / (expected.item() + 1e-6)
    for p, f in zip(params, full):
        torch.testing.assert_close(p.grad.full_tensor(), f * scale)
    torch.testing.assert_close(plain.grad, full[2] * scale)


def test_clip_norm_is_exact_over_gradients_on_two_meshes():
    spawn(_check_clip_over_two_meshes, 2)
