"""Context parallel: layout helpers, attention vs plain SDPA on gloo ranks, config errors, parity."""

import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import RECIPES, BytesSent, build_debug, spawn
from trainlib.models.registry import get_model_spec
from trainlib.parallel.cp import shard_sequence


def _attention_matches_sdpa(rank, world, cases_by_cp):
    from torch.distributed.device_mesh import init_device_mesh

    from trainlib.parallel.cp import cp_sdpa

    # one launch covers both degrees: cp=4 over all ranks, cp=2 inside (2, 2)
    meshes = {world: init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    for cp, cases in cases_by_cp.items():
        group, cp_rank = meshes[cp].get_group(), meshes[cp].get_local_rank()
        for seq, heads, kv_heads, load_balance in cases:
            g = torch.Generator().manual_seed(seq * 31 + heads)
            q = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64)
            k = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64)
            v = torch.randn(2, kv_heads, seq, 16, generator=g, dtype=torch.float64)
            dout = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=heads != kv_heads)
            ref.backward(dout)

            def mine(t):
                return shard_sequence(t, cp, cp_rank, load_balance, dim=2)

            for kernel in ("lse", "mask"):
                local = [mine(t).requires_grad_() for t in (q, k, v)]
                out = cp_sdpa(*local, group=group, cp=cp, rank=cp_rank, load_balance=load_balance, kernel=kernel)
                out.backward(mine(dout))
                what = f"{kernel} cp={cp} seq={seq} heads={heads}/{kv_heads} lb={load_balance} rank={rank}"
                torch.testing.assert_close(out, mine(ref), msg=lambda m, w=what: f"{w}: {m}")
                for name, t, r in zip("qkv", local, ref_in):
                    torch.testing.assert_close(t.grad, mine(r.grad), msg=lambda m, w=f"d{name} {what}": f"{w}: {m}")


def _document_attention_matches_reference(rank, world, cases_by_cp):
    """cp_sdpa under a document mask (the model's mask builder with this rank's layout
    positions, as apply_cp wires it) gives this rank's rows of per-document causal
    attention, and its dq/dk/dv, in float64; documents cross the chunk boundaries."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import doc_ids_from_starts, per_document_attention
    from trainlib.models.llama3.model import Attention, document_mask
    from trainlib.parallel.cp import cp_sdpa, layout_positions

    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    meshes = {world: init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)),
              2: init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    for cp, cases in cases_by_cp.items():
        group, cp_rank = meshes[cp].get_group(), meshes[cp].get_local_rank()
        for seq, heads, kv_heads, load_balance, starts in cases:
            g = torch.Generator().manual_seed(seq * 7 + heads)
            q, k, v, dout = (torch.randn(2, n, seq, 8, generator=g, dtype=torch.float64)
                             for n in (heads, kv_heads, kv_heads, heads))
            doc_ids = doc_ids_from_starts(starts, seq)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = per_document_attention(*ref_in, doc_ids)
            ref.backward(dout)

            def mine(t):
                return shard_sequence(t, cp, cp_rank, load_balance, dim=2)

            q_pos = layout_positions(seq, cp, cp_rank, load_balance)
            for flex in (False, True):  # flex: forward only (no flex backward on CPU)
                local = [mine(t).requires_grad_(not flex) for t in (q, k, v)]
                out = cp_sdpa(*local, document_mask(doc_ids, torch.float64, q_pos, flex=flex), group=group, cp=cp,
                              rank=cp_rank, load_balance=load_balance, attend=Attention.sdpa)
                what = f"flex={flex} cp={cp} seq={seq} heads={heads}/{kv_heads} lb={load_balance} rank={rank}"
                torch.testing.assert_close(out, mine(ref), msg=lambda m, w=what: f"{w}: {m}")
                if not flex:
                    out.backward(mine(dout))
                    for name, t, r in zip("qkv", local, ref_in):
                        torch.testing.assert_close(t.grad, mine(r.grad), msg=lambda m, w=f"d{name} {what}": f"{w}: {m}")


def _model_matches_single_device(rank, world, cp_mesh):
    """The whole model under apply_cp (routing + RoPE positions from the hook)
    gives this rank's rows of the single-device logits, and the cp-summed
    parameter gradients equal the single-device ones."""
    import copy

    import torch.distributed as dist

    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.parallel.cp import apply_cp

    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    # float32 as in training (RMSNorm and RoPE compute in float32 anyway)
    ref = Transformer(get_model_args("debug", n_layers=2), rope_len=32)
    ref.init_weights(seed=0)
    model = apply_cp(copy.deepcopy(ref), cp_mesh)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (2, 32), generator=g)
    weights = torch.randn(2, 32, 512, generator=g)

    # causal, and document-masked (documents across the chunk boundaries, whole documents
    # passed as ids of the whole window as the loop does)
    from tests.helpers import doc_ids_from_starts

    for doc_ids in (None, doc_ids_from_starts([[0, 5, 6, 19], [0, 27]], 32)):
        ref.zero_grad()
        model.zero_grad()
        ref_logits = ref(tokens, doc_ids=doc_ids)
        (ref_logits * weights).sum().backward()
        logits = model(shard_sequence(tokens, cp, cp_rank), doc_ids=doc_ids)
        (logits * shard_sequence(weights, cp, cp_rank)).sum().backward()
        torch.testing.assert_close(logits, shard_sequence(ref_logits.detach(), cp, cp_rank), rtol=1e-5, atol=1e-5)
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            dist.all_reduce(p.grad, group=cp_mesh.get_group())
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    causal = ref(tokens)
    assert (causal - ref(tokens, doc_ids=doc_ids)).abs().max() > 1e-3  # the documents did change the logits


def _contiguous_layout_reaches_model_and_batches(rank, world):
    """parallelism.cp_load_balance = false through trainlib's own path (parallelize_llama,
    and local_micro_batches as the training and validation loops cut batches): this
    rank holds one contiguous chunk and gets its rows of the single-device logits.
    Either layout trains to the same loss, so parity alone cannot see the key ignored."""
    from trainlib.models.llama3 import Transformer, get_model_args, parallelize_llama
    from trainlib.parallel import ParallelDims, init_model_weights
    from trainlib.parallel.config import ParallelismConfig
    from trainlib.parallel.cp import local_micro_batches

    dims = ParallelDims(dp_shard=1, cp=world, world_size=world)
    dims.build_mesh("cpu")
    par = ParallelismConfig(dp_shard=1, cp=world, cp_load_balance=False)
    args = get_model_args("debug", n_layers=2)
    with torch.device("meta"):
        model = Transformer(args, rope_len=32)
    parallelize_llama(model, dims, par)
    init_model_weights(model, 0, "cpu")
    ref = Transformer(args, rope_len=32)
    ref.init_weights(seed=0)

    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    (mb,) = local_micro_batches([{"input": tokens, "labels": tokens}], dims.mesh("cp"), par.cp_load_balance,
                                document_mask=False, device=torch.device("cpu"))
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)
    assert torch.equal(mb["input"], tokens[:, mine])
    with torch.no_grad():
        torch.testing.assert_close(model(mb["input"]), ref(tokens)[:, mine], rtol=1e-5, atol=1e-5)


def _cp_bytes_are_planned(rank, world):
    """Per block, the K/V all-gather (again when AC reruns the block) and the reduce-scatter of their
    gradients: a real step's cp collectives and the bytes each rank sends in them are the planner's."""
    from trainlib.config import load_job_config
    from trainlib.parallel import ParallelDims
    from trainlib.parallel.cp import local_micro_batches
    from trainlib.plan.comm import cp_bytes

    tokens = torch.randint(0, 512, (1, 65), generator=torch.Generator().manual_seed(0))
    layout = ["--parallelism.cp=2", "--parallelism.dp_shard=2"]
    dims = ParallelDims.from_config(load_job_config(str(RECIPES / "debug.toml"), layout).parallelism, world)
    dims.build_mesh("cpu")
    for mode, recomputed in (("none", 0), ("full", 4), ("selective_op", 4), ("selective_layer", 2)):
        cfg, built = build_debug(dims, [*layout, f"--activation_checkpoint.mode={mode}"])
        (model,) = built.parts
        (mb,) = local_micro_batches([{"input": tokens[:, :-1], "labels": tokens[:, 1:]}], dims.mesh("cp"),
                                    load_balance=True, document_mask=False, device=torch.device("cpu"))
        # FSDP shards over dp_shard x cp too: its collectives move flat parameter buffers, CP's [.., seq, head_dim].
        with BytesSent(2, keep=lambda t: t.dim() > 1) as sent:
            built.loss_fn(model(mb["input"]), mb["labels"]).backward()
        blocks = built.model_args.n_layers
        assert sent.counts == {"all_gather": blocks + recomputed, "reduce_scatter": blocks}, (mode, sent.counts)
        block = get_model_spec(cfg.model.name).block_shapes(built.model_args)[0]
        shape = SimpleNamespace(block=block, tp=1, cp=2, cp_ulysses=1, elem=4, mb_tokens=mb["input"].numel())
        assert sent.bytes == cp_bytes(shape, cfg.activation_checkpoint, blocks), (mode, sent.bytes)


def _cp_checks(rank, world, cases_by_cp, document_cases_by_cp):
    from torch.distributed.device_mesh import init_device_mesh

    _attention_matches_sdpa(rank, world, cases_by_cp)
    _document_attention_matches_reference(rank, world, document_cases_by_cp)
    _model_matches_single_device(rank, world, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    _contiguous_layout_reaches_model_and_batches(rank, world)
    _cp_bytes_are_planned(rank, world)


def test_attention_and_grads_match_sdpa():
    """Output and dq/dk/dv equal plain causal SDPA (float64) for several
    lengths, degrees, GQA ratios and both layouts; under a document mask they
    equal per-document causal attention; then the whole model, both masks; and
    the collectives of a cp=2 step are what the planner counts."""
    spawn(_cp_checks, 4, {
        2: [(8, 4, 2, True), (32, 4, 4, True), (48, 6, 2, True), (24, 4, 2, False), (64, 2, 1, False)],
        4: [(16, 4, 2, True), (40, 4, 1, False), (64, 4, 4, True)],
    }, {
        2: [(32, 4, 2, True, [[0, 3, 4, 17], [0, 9, 24]]), (24, 2, 1, False, [[0, 12], [0, 1, 2, 13]])],
        4: [(48, 4, 2, True, [[0, 7, 30, 31], [0, 40]]), (40, 4, 4, False, [[0, 11], [0]])],
    })




# ------------------------------------------------------- MLA-shaped attention (issue 51)
# q/k 24 wide, v 16 (MLA's nope + rope against its value width), GQA, and a softmax scale that is not
# the default 24 ** -0.5 (MLA's carries YaRN's mscale): every CP kernel against the single-process kernel.
MLA_SCALE = 0.37


def mla_inputs(seq, heads, kv_heads, seed, dtype=torch.float64):
    """q, k, v, dout of the whole sequence: q/k width 24, v (and the output) width 16."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, seq, d, generator=g, dtype=dtype)
            for n, d in ((heads, 24), (kv_heads, 24), (kv_heads, 16), (heads, 16))]


def mla_reference(q, k, v, dout, mask=None, scale=MLA_SCALE):
    """Single-process `trainlib.blocks.attention.sdpa` on the whole sequence: output and dq/dk/dv."""
    from trainlib.blocks.attention import sdpa

    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa(*ins, mask, scale=scale)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in ins]


def mla_block_shape(heads, kv_heads):
    """The planner's description of that attention: q/k heads 24 wide, v heads 16."""
    from trainlib.models.spec import BlockShape

    return BlockShape(dim=96, n_heads=heads, n_kv_heads=kv_heads, head_dim=24, ffn_dim=0, v_head_dim=16)


def assert_matches(got, want, mine, what):
    """got: (out, dq, dk, dv) of this rank; want: the whole sequence's, cut by `mine`."""
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, mine(r), msg=lambda m, w=f"{name} {what}": f"{w}: {m}")


def assert_max_logits_over_cp(got, group, q, k, mask):
    """MuonClip's measurement under CP: this rank's per-head max logits, max-reduced over the cp group,
    equal the one-process value of the whole window's q and k (causal, or the whole window's `mask`)."""
    from trainlib.blocks.attention import max_logits

    got = got.clone()
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
    want = max_logits(q, k, mask, scale=MLA_SCALE)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(want, max_logits(q, k, mask, scale=None))  # the scale reached the measurement


def _mla_shaped_all_gather(rank, world):
    """cp_sdpa at cp = 2 (inside (2, 2)) with v narrower than q and k and a non-default scale: both
    kernels causal, both layouts, and under a document mask (the model's masked kernel on the gathered
    K/V), equal the single-process kernel's output and gradients (float64); K and V move in one
    all-gather and one reduce-scatter of the bytes the planner prices for that BlockShape."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.helpers import doc_ids_from_starts
    from trainlib.blocks.attention import Attention, document_mask, sdpa
    from trainlib.parallel.cp import cp_sdpa, layout_positions
    from trainlib.plan.comm import cp_bytes

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    group, cp_rank = mesh.get_group(), mesh.get_local_rank()
    q, k, v, dout = mla_inputs(32, 4, 2, seed=5)
    doc_ids = doc_ids_from_starts([[0, 3, 4, 17], [0, 9, 24]], 32)
    full_mask = document_mask(doc_ids, torch.float64, flex=False)
    causal_ref, doc_ref = mla_reference(q, k, v, dout), mla_reference(q, k, v, dout, full_mask)
    assert (causal_ref[0] - mla_reference(q, k, v, dout, scale=None)[0]).abs().max() > 0.1  # the scale matters
    for load_balance in (True, False):
        def mine(t):
            return shard_sequence(t, 2, cp_rank, load_balance, dim=2)

        q_pos = layout_positions(32, 2, cp_rank, load_balance)
        for kernel in ("lse", "mask", "document"):
            local = [mine(t).requires_grad_() for t in (q, k, v)]
            mask = document_mask(doc_ids, torch.float64, q_pos, flex=False) if kernel == "document" else None
            attn = Attention()  # MuonClip's measurement around the CP kernel, as StepRunner.enable_qk_clip
            attn.sdpa = functools.partial(cp_sdpa, group=group, cp=2, rank=cp_rank, load_balance=load_balance,
                                          kernel="auto" if kernel == "document" else kernel, attend=sdpa)
            attn.measure_max_logits()
            with BytesSent(2) as sent:
                out = attn.sdpa(*local, mask, scale=MLA_SCALE)
                out.backward(mine(dout))
            assert_max_logits_over_cp(attn.max_logit, group, q, k, full_mask if mask is not None else None)
            assert out.shape[-1] == 16
            assert sent.counts == {"all_gather": 1, "reduce_scatter": 1}, sent.counts
            shape = SimpleNamespace(block=mla_block_shape(4, 2), tp=1, cp=2, cp_ulysses=1, elem=8,
                                    mb_tokens=local[0].shape[0] * local[0].shape[2])
            assert sent.bytes == cp_bytes(shape, SimpleNamespace(mode="none", every_k=1), 1), sent.bytes
            assert_matches([out.detach()] + [t.grad for t in local], doc_ref if mask is not None else causal_ref,
                           mine, f"{kernel} lb={load_balance} rank={rank}")


def test_mla_shaped_attention_matches_single_process():
    """All-gather CP with q/k 24 wide, v 16, GQA 4/2 and scale 0.37: output and dq/dk/dv equal
    `trainlib.blocks.attention.sdpa(..., scale=0.37)` on the whole sequence (float64)."""
    spawn(_mla_shaped_all_gather, 4)
