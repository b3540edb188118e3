"""Ulysses and hybrid context parallel (issue 45): the all-to-all attention against plain attention on
gloo ranks (outputs and gradients, causal and document-masked), and the whole model under apply_cp."""

import functools

import torch
import torch.nn.functional as F

from tests.distributed.test_cp import (MLA_SCALE, assert_matches, assert_max_logits_over_cp, mla_block_shape,
                                       mla_inputs, mla_reference)
from tests.helpers import doc_ids_from_starts, per_document_attention, spawn
from trainlib.blocks.attention import Attention, document_mask
from trainlib.parallel.cp import shard_sequence


def _attention_matches_reference(rank, world, cases_by_u):
    """ulysses_sdpa over u ranks (u = 2 inside (2, 2), u = 4 over all) with the model's kernel:
    this rank's rows of causal SDPA, or of per-document attention under the whole window's mask,
    and dq/dk/dv, in float64; KV heads that u does not divide are replicated (4/2 and 4/1 at u=4)."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainlib.blocks.attention import document_mask, sdpa
    from trainlib.parallel.ulysses import ulysses_sdpa

    meshes = {world: init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    for u, cases in cases_by_u.items():
        group, u_rank = meshes[u].get_group(), meshes[u].get_local_rank()
        for seq, heads, kv_heads, starts in cases:
            g = torch.Generator().manual_seed(seq * 13 + heads * 3 + kv_heads)
            q, k, v, dout = (torch.randn(2, n, seq, 8, generator=g, dtype=torch.float64)
                             for n in (heads, kv_heads, kv_heads, heads))
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            if starts is None:
                mask = None
                ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=heads != kv_heads)
            else:
                doc_ids = doc_ids_from_starts(starts, seq)
                mask = document_mask(doc_ids, torch.float64, flex=False)
                ref = per_document_attention(*ref_in, doc_ids)
            ref.backward(dout)

            def mine(t):
                return shard_sequence(t, u, u_rank, dim=2, ulysses=u)

            local = [mine(t).requires_grad_() for t in (q, k, v)]
            out = ulysses_sdpa(*local, mask, group=group, u=u, attend=sdpa)
            out.backward(mine(dout))
            what = f"u={u} seq={seq} heads={heads}/{kv_heads} docs={starts} rank={rank}"
            torch.testing.assert_close(out, mine(ref), msg=lambda m, w=what: f"{w}: {m}")
            for name, t, r in zip("qkv", local, ref_in):
                torch.testing.assert_close(t.grad, mine(r.grad), msg=lambda m, w=f"d{name} {what}": f"{w}: {m}")


def _model_matches_single_device(rank, world, method, ulysses):
    """The whole model under apply_cp (a ParallelDims mesh; hybrid: cp_outer x cp_inner) gives this
    rank's rows of the single-device logits and the cp-summed gradients equal the single-device
    ones, causal and document-masked (documents across every boundary of the layout)."""
    import copy

    import torch.distributed as dist

    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.parallel import ParallelDims
    from trainlib.parallel.cp import apply_cp

    dims = ParallelDims(dp_shard=1, cp=world, world_size=world, cp_ulysses=ulysses)
    dims.build_mesh("cpu")
    hybrid = 1 < ulysses < world
    cp_mesh = dims.mesh("cp")
    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    ref = Transformer(get_model_args("debug", n_layers=2), rope_len=32)  # 4 heads, 2 kv heads
    ref.init_weights(seed=0)
    model = apply_cp(copy.deepcopy(ref), cp_mesh, ulysses=ulysses,
                     outer_mesh=dims.mesh("cp_outer") if hybrid else None,
                     inner_mesh=dims.mesh("cp_inner") if hybrid else None)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 32), generator=g)
    weights = torch.randn(2, 32, 512, generator=g)
    mine = functools.partial(shard_sequence, cp=cp, rank=cp_rank, ulysses=ulysses)
    for doc_ids in (None, doc_ids_from_starts([[0, 5, 6, 19], [0, 27]], 32)):
        ref.zero_grad()
        model.zero_grad()
        ref_logits = ref(tokens, doc_ids=doc_ids)
        (ref_logits * weights).sum().backward()
        logits = model(mine(tokens), doc_ids=doc_ids)
        (logits * mine(weights)).sum().backward()
        what = f"{method} cp={cp} ulysses={ulysses} docs={doc_ids is not None} rank={rank}"
        torch.testing.assert_close(logits, mine(ref_logits.detach()), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, w=what: f"{w}: {m}")
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            dist.all_reduce(p.grad, group=cp_mesh.get_group())
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, name=name, w=what: f"{w} {name}: {m}")


def _bytes_are_planned(rank, world):
    """The key reaches the step (parity cannot tell the methods apart): a real step under cp_method =
    ulysses runs per block two all-to-alls forward and two backward (again where AC reruns the block) and
    no K/V all-gather; hybrid adds the all-gather over cp_outer; the bytes sent are the planner's lines."""
    from types import SimpleNamespace

    from tests.helpers import BytesSent, build_debug
    from trainlib.config import load_job_config
    from trainlib.models.registry import get_model_spec
    from trainlib.parallel import ParallelDims
    from trainlib.parallel.cp import local_micro_batches
    from trainlib.plan.comm import cp_bytes, ulysses_bytes

    tokens = torch.randint(0, 512, (1, 65), generator=torch.Generator().manual_seed(0))
    # hybrid's two groups have 2 ranks each, as BytesSent's single n needs
    hybrid = ["--parallelism.cp=4", "--parallelism.cp_method=hybrid", "--parallelism.cp_ulysses=2"]
    for layout, n, u in ((["--parallelism.cp=4", "--parallelism.cp_method=ulysses"], 4, 4), (hybrid, 2, 2)):
        dims = ParallelDims.from_config(load_job_config(None, layout).parallelism, world)
        dims.build_mesh("cpu")
        for mode, recomputed in (("none", 0), ("full", 1)):
            cfg, built = build_debug(dims, [*layout, f"--activation_checkpoint.mode={mode}"])
            (model,) = built.parts
            (mb,) = local_micro_batches([{"input": tokens[:, :-1], "labels": tokens[:, 1:]}], dims.mesh("cp"),
                                        load_balance=True, document_mask=False, device=torch.device("cpu"),
                                        ulysses=u)
            with BytesSent(n, keep=lambda t: t.dim() > 1) as sent:  # FSDP's flat buffers are 1-D
                built.loss_fn(model(mb["input"]), mb["labels"]).backward()
            blocks = built.model_args.n_layers
            expected = {"all_to_all": (4 + 2 * recomputed) * blocks}
            if u < 4:
                expected |= {"all_gather": (1 + recomputed) * blocks, "reduce_scatter": blocks}
            assert sent.counts == expected, (layout, mode, sent.counts)
            block = get_model_spec(cfg.model.name).block_shapes(built.model_args)[0]
            shape = SimpleNamespace(block=block, tp=1, cp=4, cp_ulysses=u, elem=4, mb_tokens=mb["input"].numel())
            ac = cfg.activation_checkpoint
            assert sent.bytes_by_kind["all_to_all"] == ulysses_bytes(shape, ac, blocks), (layout, mode)
            if u < 4:
                kv = sent.bytes_by_kind["all_gather"] + sent.bytes_by_kind["reduce_scatter"]
                assert kv == cp_bytes(shape, ac, blocks), (layout, mode)


def _checks(rank, world, cases_by_u):
    _attention_matches_reference(rank, world, cases_by_u)
    _model_matches_single_device(rank, world, "ulysses", world)
    _model_matches_single_device(rank, world, "hybrid", 2)
    _bytes_are_planned(rank, world)


def test_ulysses_and_hybrid_match_plain_attention():
    """On 4 gloo ranks: the all-to-all attention at u = 2 and 4 (GQA with replicated KV heads, documents
    across the ranks' parts), then the debug model under Ulysses cp=4 and hybrid 2 x 2."""
    spawn(_checks, 4, {
        2: [(16, 4, 2, None), (24, 2, 1, None), (32, 4, 4, [[0, 3, 4, 17], [0, 9, 24]])],
        4: [(16, 4, 2, None), (32, 8, 1, None), (40, 4, 2, [[0, 7, 30, 31], [0, 12]])],
    })


# ------------------------------------------------------- MLA-shaped attention (issue 51)
class _ScaledAttention(Attention):
    """An attention module as a family writes one: it calls its kernel through `self.sdpa` with a scale."""

    def forward(self, q, k, v, mask, scale):
        return self.sdpa(q, k, v, mask, scale=scale)


class _AttentionOnly(torch.nn.Module):
    """The least a model needs for apply_cp: attention modules and, for document masks, `attention_mask`."""

    def __init__(self):
        super().__init__()
        self.attn = _ScaledAttention()

    def attention_mask(self, doc_ids, dtype, q_positions=None):
        return document_mask(doc_ids, dtype, q_positions, flex=False)

    def forward(self, q, k, v, doc_ids=None, position_ids=None):
        mask = None if doc_ids is None else self.attention_mask(doc_ids, q.dtype)
        return self.attn(q, k, v, mask, MLA_SCALE)


def _mla_shaped_ulysses_and_hybrid(rank, world):
    """q/k 24 wide, v 16, GQA and a non-default scale through apply_cp's composition (the module calls
    `self.sdpa(q, k, v, mask, scale=s)`): Ulysses cp = 2 (inside (2, 2); KV heads 1, replicated) and
    hybrid 2 x 2 (4 ranks; the all-to-all, then the all-gather, then the module's own kernel), causal and
    document-masked, equal the single-process kernel's output and gradients (float64); the collectives
    send the bytes the planner prices for that BlockShape."""
    from types import SimpleNamespace

    from tests.helpers import BytesSent
    from trainlib.parallel import ParallelDims
    from trainlib.parallel.cp import apply_cp
    from trainlib.plan.comm import cp_bytes, ulysses_bytes

    doc_ids = doc_ids_from_starts([[0, 5, 6, 19], [0, 27]], 32)
    hybrid = ParallelDims(dp_shard=1, cp=world, world_size=world, cp_ulysses=2)
    hybrid.build_mesh("cpu")
    ulysses = ParallelDims(dp_shard=world // 2, cp=2, world_size=world, cp_ulysses=2)
    ulysses.build_mesh("cpu")
    for name, dims, kv_heads in (("ulysses cp=2", ulysses, 1), ("hybrid 2x2", hybrid, 2)):
        q, k, v, dout = mla_inputs(32, 4, kv_heads, seed=kv_heads)
        cp_mesh = dims.mesh("cp")
        cp, u = cp_mesh.size(), 2
        outer = {"outer_mesh": dims.mesh("cp_outer"), "inner_mesh": dims.mesh("cp_inner")} if cp > u else {}
        model = apply_cp(_AttentionOnly(), cp_mesh, ulysses=u, **outer)
        model.attn.measure_max_logits()  # MuonClip's measurement around the composed kernels
        mine = functools.partial(shard_sequence, cp=cp, rank=cp_mesh.get_local_rank(), dim=2, ulysses=u)
        for docs in (None, doc_ids):
            want = mla_reference(q, k, v, dout, None if docs is None else document_mask(docs, torch.float64,
                                                                                         flex=False))
            local = [mine(t).requires_grad_() for t in (q, k, v)]
            with BytesSent(2) as sent:  # both of hybrid's groups have 2 ranks
                out = model(*local, doc_ids=docs)
                out.backward(mine(dout))
            got, model.attn.max_logit = model.attn.max_logit, None  # -inf outside this rank's head slice
            assert got.isinf().any() and not got.isinf().all(), (name, got)
            assert_max_logits_over_cp(got, cp_mesh.get_group(), q, k,
                                      None if docs is None else document_mask(docs, torch.float64, flex=False))
            assert out.shape[-1] == 16
            shape = SimpleNamespace(block=mla_block_shape(4, kv_heads), tp=1, cp=cp, cp_ulysses=u, elem=8,
                                    mb_tokens=local[0].shape[0] * local[0].shape[2])
            none = SimpleNamespace(mode="none", every_k=1)
            assert sent.bytes_by_kind["all_to_all"] == ulysses_bytes(shape, none, 1), (name, sent.bytes_by_kind)
            if cp > u:
                kv = sent.bytes_by_kind["all_gather"] + sent.bytes_by_kind["reduce_scatter"]
                assert kv == cp_bytes(shape, none, 1), (name, sent.bytes_by_kind)
            assert sent.counts == ({"all_to_all": 4} | ({"all_gather": 1, "reduce_scatter": 1} if cp > u else {})), \
                (name, sent.counts)
            assert_matches([out.detach()] + [t.grad for t in local], want, mine,
                           f"{name} docs={docs is not None} rank={rank}")


def test_mla_shaped_ulysses_and_hybrid_match_single_process():
    """Ulysses cp=2 and hybrid 2x2 with q/k 24 wide, v 16, GQA and scale 0.37 reaching the kernel through
    apply_cp: output and dq/dk/dv equal `trainlib.blocks.attention.sdpa(..., scale=0.37)` (float64)."""
    spawn(_mla_shaped_ulysses_and_hybrid, 4)
