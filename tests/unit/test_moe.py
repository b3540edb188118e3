"""The MoE block (trainlib.blocks.moe) on one process: routing, the grouped matmul against the reference loop,
capacity, the load-balance losses' gradients, the bias update, counting under activation checkpointing."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainlib.errors import ConfigError
from trainlib.blocks.moe import MoE, MoEArgs, MoEConfig, aux_loss_scale, moe_layers
from trainlib.step import aux_fields

DIM = 16


def _moe(seed=0, cfg=None, **kw) -> MoE:
    args = dict(n_experts=8, top_k=2, expert_dim=12) | kw
    torch.manual_seed(seed)
    m = MoE(DIM, MoEArgs(**args))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m.init_buffers()
    m.configure(cfg or MoEConfig())
    return m


def _x(b=3, s=10, seed=1):
    return torch.randn(b, s, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kw,cfg", [
    ({}, {}),
    ({"score_func": "sigmoid", "n_groups": 4, "topk_groups": 2, "n_shared_experts": 1, "route_scale": 2.5}, {}),
    ({"route_norm": False}, {"capacity_factor": 0.5}),
    ({}, {"seq_aux_loss_coef": 0.1, "z_loss_coef": 0.01}),
])
def test_grouped_matmul_matches_the_reference_loop(kw, cfg):
    """Forward and every gradient within 1e-6 in fp32 (the issue's bound), routing options included."""
    outs = []
    for grouped in (True, False):
        m = _moe(**kw, cfg=MoEConfig(**cfg, grouped_mm=grouped))
        x = _x().requires_grad_()
        with aux_loss_scale(1 / 30):
            y = m(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append([y.detach(), x.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_routing_softmax_topk_renormalised_as_written():
    """What a Qwen3-MoE checkpoint was trained with: softmax over the fp32 gate, top-k, weights renormalised."""
    m = _moe()
    x = _x(1, 6)
    logits = x.reshape(-1, DIM) @ m.router.gate.weight.T
    probs = logits.softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    got_idx, got_w, _, _ = m.router(x.reshape(-1, DIM))
    assert torch.equal(got_idx, idx)
    torch.testing.assert_close(got_w, w)
    # and the block's output is the weighted sum of the chosen experts' SwiGLU outputs
    e = m.experts
    xf = x.reshape(-1, DIM)
    want = torch.stack([sum(w[t, j] * (F.silu(xf[t] @ e.w1[idx[t, j]].T) * (xf[t] @ e.w3[idx[t, j]].T))
                            @ e.w2[idx[t, j]].T for j in range(2)) for t in range(6)])
    torch.testing.assert_close(m(x).reshape(6, DIM), want, rtol=1e-5, atol=1e-6)


def test_bias_steers_selection_not_weights():
    m = _moe()
    xf = _x(1, 6).reshape(-1, DIM)
    _, _, scores, _ = m.router(xf)
    bias = torch.zeros(8)
    bias[5] = 100.0  # every token picks expert 5
    idx, w, _, _ = m.router(xf, bias)
    assert (idx == 5).any(-1).all()
    chosen = scores.gather(1, idx)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True))  # the bias is not in the weights


def test_group_limited_routing_stays_in_the_best_groups():
    m = _moe(score_func="sigmoid", n_groups=4, topk_groups=1)
    xf = _x(2, 10).reshape(-1, DIM)
    idx, _, scores, _ = m.router(xf)
    best_group = scores.view(-1, 4, 2).amax(-1).argmax(-1)
    assert torch.equal(idx // 2, best_group[:, None].expand_as(idx))


def _top2_sum_reference(logits, bias, n_groups, topk_groups, top_k, route_scale):
    """DeepSeek-V3's routing written token by token: sigmoid scores; groups ranked by the sum of their two best
    biased scores; the best top_k biased scores among the kept groups' experts; weights = the unbiased scores
    of those, normalised to 1, times route_scale."""
    scores = logits.sigmoid()
    size = scores.shape[1] // n_groups
    all_idx, all_w = [], []
    for t in range(scores.shape[0]):
        biased = [float(v) for v in scores[t] + bias]
        group_rank = [sum(sorted(biased[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_groups)]
        kept = sorted(range(n_groups), key=lambda g: -group_rank[g])[:topk_groups]
        allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:top_k]
        w = scores[t, chosen]
        all_idx.append(sorted(chosen))
        all_w.append(dict(zip(chosen, (w / w.sum() * route_scale).tolist())))
    return all_idx, all_w


def test_top2_sum_group_routing_matches_a_hand_written_reference():
    """group_score="top2_sum" (DeepSeek-V3): a group ranks by its two best biased scores. The bias chosen here
    makes one group the best by its single best expert but not by its best two, so "max" routes elsewhere."""
    kw = dict(n_experts=16, top_k=3, score_func="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5)
    m = _moe(group_score="top2_sum", **kw)
    xf = _x(2, 12).reshape(-1, DIM)
    bias = torch.linspace(-0.3, 0.3, 16)
    bias[0] = 2.0  # group 0: one very strong expert, the rest weak
    bias[1:4] = -2.0
    idx, w, scores, logits = m.router(xf, bias)
    torch.testing.assert_close(scores, (xf @ m.router.gate.weight.T).sigmoid())
    assert logits.dtype == scores.dtype == w.dtype == torch.float32
    want_idx, want_w = _top2_sum_reference(logits, bias, 4, 2, 3, 2.5)
    assert [sorted(row) for row in idx.tolist()] == want_idx
    for t in range(idx.shape[0]):
        for j, e in enumerate(idx[t].tolist()):
            assert abs(w[t, j].item() - want_w[t][e]) < 1e-6  # the bias steers selection, not the weights
    # the max rule keeps group 0 for every token (its one expert's bias of 2); top2_sum does not
    idx_max, _, _, _ = _moe(group_score="max", **kw).router(xf, bias)
    assert (idx_max // 4 == 0).any(-1).all() and not (idx // 4 == 0).any(-1).all()
    with pytest.raises(ConfigError, match=r"^model.moe group_score 'top2_sum' ranks a group by its two best"):
        MoEArgs(n_experts=4, top_k=1, expert_dim=8, n_groups=4, topk_groups=2, group_score="top2_sum").validate()


def test_capacity_keeps_each_experts_highest_weighted_assignments_and_counts_the_rest():
    m = _moe(cfg=MoEConfig(capacity_factor=0.5))
    x = _x(2, 12)
    xf = x.reshape(-1, DIM)
    idx, w, _, _ = m.router(xf, m.expert_bias)
    cap = math.ceil(0.5 * idx.numel() / 8)
    counts = torch.bincount(idx.reshape(-1), minlength=8)
    assert counts.max() > cap  # the test drops something
    y = m(x).reshape(-1, DIM)
    stats = m.take_stats()
    assert stats[8] == (counts - counts.clamp(max=cap)).sum() and stats[9] == idx.numel()
    # the same block without capacity, given only the kept assignments, gives the same output
    keep = torch.zeros_like(w, dtype=torch.bool)
    for e in range(8):
        pos = (idx == e).nonzero()
        order = w[pos[:, 0], pos[:, 1]].argsort(descending=True, stable=True)[:cap]
        keep[pos[order, 0], pos[order, 1]] = True
    e = m.experts
    want = torch.stack([sum((w[t, j] * (F.silu(xf[t] @ e.w1[idx[t, j]].T) * (xf[t] @ e.w3[idx[t, j]].T))
                             @ e.w2[idx[t, j]].T) for j in range(2) if keep[t, j]) if keep[t].any()
                        else torch.zeros(DIM) for t in range(24)])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def _explicit_aux(weight: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, cfg: MoEConfig, scale: float):
    """The two losses written out in the dtype of `weight` (the gate's): sequence-wise balance and z-loss,
    each token weighted by `scale`; `idx` [b, s, k] the experts the tokens chose."""
    b, s, _ = x.shape
    logits = x.reshape(b * s, -1) @ weight.T
    scores = logits.softmax(-1).view(b, s, -1)
    seq = 0
    for i in range(b):
        c = torch.bincount(idx[i].reshape(-1), minlength=8).to(weight.dtype)
        p = (scores[i] / scores[i].sum(-1, keepdim=True)).mean(0)
        seq = seq + (8 / (s * 2) * c * p).sum() * s
    z = torch.logsumexp(logits, -1).square().sum()
    return (cfg.seq_aux_loss_coef * seq + cfg.z_loss_coef * z) * scale


def test_aux_losses_reach_the_router_as_if_added_to_the_loss():
    """The gradient the two losses add to the router equals a float64 autograd of them written out."""
    cfg = MoEConfig(seq_aux_loss_coef=0.5, z_loss_coef=0.05)
    x = _x()
    got, plain = _moe(cfg=cfg), _moe(cfg=cfg)
    with aux_loss_scale(1 / 30):
        got(x).sum().backward()
    plain(x).sum().backward()  # outside the scale: no auxiliary loss
    aux_grad = got.router.gate.weight.grad - plain.router.gate.weight.grad
    assert aux_grad.abs().max() > 1e-3
    idx = got.router(x.reshape(-1, DIM), got.expert_bias)[0].view(3, 10, 2)
    weight = got.router.gate.weight.detach().double().requires_grad_()
    want = _explicit_aux(weight, x.double(), idx, cfg, 1 / 30)
    want.backward()
    # atol: aux_grad is the difference of two fp32 gradients of up to about 40
    torch.testing.assert_close(aux_grad, weight.grad.float(), rtol=1e-4, atol=1e-5)
    stats = got.take_stats()  # the terms as added, for the metrics
    torch.testing.assert_close(stats[10] + stats[11], want.detach().float())


LOAD = torch.tensor([30.0, 2, 5, 0, 9, 1, 12, 1])  # a previous global batch's assignments per expert


def test_global_aux_loss_reaches_the_router_and_below_as_its_float64_autograd():
    """E * sum_i f_i P_i, f from the previous global batch (`expert_load`), P over this forward's tokens, each
    weighted by the scale: the gradient it adds to the gate and to the block's input (the layers below) equals
    a float64 autograd of it written out."""
    cfg = MoEConfig(global_aux_loss_coef=0.5, load_balance="none")
    x = _x()
    got, plain = _moe(cfg=cfg), _moe(cfg=cfg)
    got.expert_load.copy_(LOAD)
    xg, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    with aux_loss_scale(1 / 30):
        got(xg).sum().backward()
    plain(xp).sum().backward()  # outside the scale: no auxiliary loss
    aux_w = got.router.gate.weight.grad - plain.router.gate.weight.grad
    aux_x = xg.grad - xp.grad
    assert aux_w.abs().max() > 1e-3 and aux_x.abs().max() > 1e-4
    weight = got.router.gate.weight.detach().double().requires_grad_()
    x64 = x.double().requires_grad_()
    probs = (x64.reshape(30, DIM) @ weight.T).softmax(-1)
    f = LOAD.double() / LOAD.sum()  # the share of each expert
    want = 0.5 * 8 * (f * probs.mean(0)).sum()  # 30 tokens at 1/30 each: the mean over the batch
    want.backward()
    torch.testing.assert_close(aux_w, weight.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(aux_x, x64.grad.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.take_stats()[12], want.detach().float())  # the term as added, for the metrics


def test_global_aux_loss_does_not_depend_on_the_micro_batches():
    """The fractions are the whole previous batch's, so one forward of 3 sequences and 2 micro-batches of them
    (1 + 2) give the same gradient: a fraction counted per micro-batch (or running over them) would not."""
    cfg = MoEConfig(global_aux_loss_coef=0.5)
    x = _x()
    whole, split = _moe(cfg=cfg), _moe(cfg=cfg)
    for m in (whole, split):
        m.expert_load.copy_(LOAD)
    with aux_loss_scale(1 / 30):
        whole(x).sum().backward()
        for part in (x[:1], x[1:]):
            split(part).sum().backward()
    torch.testing.assert_close(split.router.gate.weight.grad, whole.router.gate.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split.take_stats(), whole.take_stats())


def test_global_aux_loss_starts_after_the_first_step_from_its_counts():
    """Before any optimizer step there is no previous batch: no loss (the same gradient as without it). After
    one, `after_step` keeps the global counts the step runner hands it, and the loss is on."""
    x = _x()
    on, off = _moe(cfg=MoEConfig(global_aux_loss_coef=0.5)), _moe()
    with aux_loss_scale(1 / 30):
        on(x).sum().backward()
        off(x).sum().backward()
    assert torch.equal(on.router.gate.weight.grad, off.router.gate.weight.grad)
    counts = on.take_stats()[:8]
    assert counts.sum() == 60 and on.take_stats()[12] == 0
    on.after_step(counts)
    assert torch.equal(on.expert_load, counts) and "expert_load" in on.state_dict()  # a checkpoint holds it
    with aux_loss_scale(1 / 30):
        on(x)
    assert on.take_stats()[12] > 0


def test_bias_update_moves_towards_underloaded_experts_and_stays_centred():
    m = _moe()
    counts = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])  # mean 5
    m.update_bias(counts)
    delta = torch.tensor([-1.0, 1, 0, 0, 0, 0, 0, 0])
    torch.testing.assert_close(m.expert_bias, 1e-3 * (delta - delta.mean()))
    m.configure(MoEConfig(load_balance="none"))
    before = m.expert_bias.clone()
    m.update_bias(counts)
    assert torch.equal(m.expert_bias, before)
    assert "expert_bias" in m.state_dict() and "tokens_per_expert" not in m.state_dict()


def test_counts_once_under_activation_checkpointing():
    """The recompute in backward routes the same tokens again; counting them twice would double every
    count and the seq-aux values, and double the gradient of nothing: the counts must equal a plain run's."""
    cfg = MoEConfig(seq_aux_loss_coef=0.5)
    x = _x()
    plain, ac = _moe(cfg=cfg), _moe(cfg=cfg)
    with aux_loss_scale(1 / 30):
        plain(x).sum().backward()
        checkpoint(ac, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(ac.router.gate.weight.grad, plain.router.gate.weight.grad)
    assert torch.equal(ac.take_stats(), plain.take_stats())


def test_aux_fields_and_layer_lookup():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(2, 2), "3": torch.nn.Module()})
    model.layers["3"].moe = _moe()
    assert list(moe_layers([model])) == [3]
    stats = torch.zeros(4, 13)
    stats[3, :8] = torch.tensor([4.0, 0, 0, 0, 0, 0, 0, 4])  # mean 1, max 4
    stats[3, 8:] = torch.tensor([3, 8, 0.25, 0.5, 0.125])
    fields = aux_fields({"moe_stats": stats, "moe_experts": {3: 8}})
    assert fields == {"moe_aux_loss": 0.25, "moe_z_loss": 0.5, "moe_global_aux_loss": 0.125,
                      "moe_load_imbalance": {"3": 4.0}, "moe_dropped_tokens": {"3": 3}}


def test_bad_moe_settings_are_config_errors():
    with pytest.raises(ConfigError, match="top_k"):
        MoEArgs(n_experts=4, top_k=5, expert_dim=8).validate()
    with pytest.raises(ConfigError, match="n_groups"):
        MoEArgs(n_experts=6, top_k=2, expert_dim=8, n_groups=4).validate()
    for bad in (-1, 0):  # 0 once meant dropless; now it would drop everything
        with pytest.raises(ConfigError, match='moe.capacity_factor must be > 0.*moe.capacity_factor = "dropless"'):
            MoEConfig(capacity_factor=bad)
    assert MoEConfig().dropless and not MoEConfig(capacity_factor=1.25).dropless
    with pytest.raises(ConfigError, match="moe.global_aux_loss_coef"):
        MoEConfig(global_aux_loss_coef=-0.1)
    with pytest.raises(ConfigError, match="load_balance"):
        MoEConfig(load_balance="aux")


def test_pipeline_stage_metadata_inference_is_where_trainlib_expects_it():
    """trainlib.parallel.pp leaves torch's stage metadata inference out of the routing counts by overriding
    this method; a torch that renames it would count placeholder forwards silently."""
    from torch.distributed.pipelining import PipelineStage

    from trainlib.parallel.pp import _Stage

    assert "_forward_metadata_inference" in vars(PipelineStage)
    assert "_forward_metadata_inference" in vars(_Stage)


def test_compiled_block_computes_what_eager_does_with_its_one_graph_break():
    """torch.compile of an MoE block, inside activation checkpointing as trainlib.parallel.compile puts it: the
    router and the auxiliary losses before the routed experts and the shared experts after them compile (two
    graphs); the routed experts run eagerly between them (`MoE._routed`, the one graph break). Output, every
    gradient (the auxiliary losses' included: a compiled graph dropped them when they joined there) and the
    routing statistics (counted once, not again by the recompute) equal eager's. aot_eager: dynamo and
    autograd's tracing without inductor's C++ build."""
    import torch._dynamo.utils as dynamo_utils

    cfg = MoEConfig(z_loss_coef=0.01, global_aux_loss_coef=0.1, seq_aux_loss_coef=0.1, capacity_factor=0.5)
    x = _x()
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        m = _moe(cfg=cfg, n_shared_experts=1)
        m.expert_load.copy_(LOAD)
        block = torch.compile(m, backend="aot_eager") if compiled else m
        xi = x.clone().requires_grad_()
        with aux_loss_scale(torch.tensor(1 / 30)):  # backward too, as the step runner: the recompute sees it
            y = checkpoint(block, xi, use_reentrant=False) if compiled else block(xi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs.append([y.detach(), xi.grad, m.take_stats()] + [p.grad for p in m.parameters()])
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2, dict(dynamo_utils.counters["stats"])
    breaks = dynamo_utils.counters["graph_break"]
    assert sum(breaks.values()) == 1 and "MoE dispatch" in str(list(breaks)), dict(breaks)
    assert runs[0][2][8] > 0 and runs[0][2][10:].abs().min() > 0  # drops and all three auxiliary terms
    for eager, compiled in zip(*runs, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


def test_a_family_chooses_the_moe_parts_and_the_axes_find_them_by_base_class():
    """MoE(router=, experts=, shared_experts=): a family's own subclasses replace the parts; moe_layers and the
    parallel code find them by the base classes (trainlib.blocks.moe), so nothing else changes."""
    from trainlib.blocks.moe import GroupedExperts, Router, SharedExperts

    class FirstExpertFirst(Router):  # a routing rule of its own: every token's first choice is expert 0
        def forward(self, x, bias=None):
            top_idx, weights, scores, logits = super().forward(x, bias)
            top_idx = top_idx.clone()
            top_idx[:, 0] = 0
            return top_idx, weights, scores, logits

    class Experts(GroupedExperts):
        pass

    class Shared(SharedExperts):
        pass

    args = MoEArgs(n_experts=4, top_k=2, expert_dim=8, n_shared_experts=1)
    moe = MoE(16, args, router=FirstExpertFirst, experts=Experts, shared_experts=Shared)
    assert (type(moe.router), type(moe.experts), type(moe.shared_experts)) == (FirstExpertFirst, Experts, Shared)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe(torch.randn(2, 5, 16))
    counts = moe.take_stats()[:4]
    assert counts[0] >= 10  # each of the 10 tokens chose expert 0
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    holder.layers["0"].moe = moe
    assert moe_layers([holder]) == {0: moe}
