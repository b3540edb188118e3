"""The CUDA-only halves of issue 44's speed paths, checked against references computed from the same inputs:
the chunked loss's fp32 sum inside the GEMM, trainlib's compiled AdamW, the bf16 weight copies under a
compiled block. Skipped without CUDA; `python -m pytest -m gpu tests/gpu/test_speed_paths.py` (~1 min)."""

import pytest
import torch
from torch import nn

from tests.helpers import needs_cuda
from tests.unit.test_adamw import assert_same_update

pytestmark = [pytest.mark.gpu, needs_cuda]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_the_loss_adds_each_bf16_chunk_product_into_the_fp32_sum_inside_the_gemm():
    from trainlib.loss import add_product_

    torch.manual_seed(0)
    vocab, dim, chunk, chunks = 4096, 1024, 512, 4
    gs = [torch.randn(chunk, vocab, device="cuda").mul_(1e-3).bfloat16() for _ in range(chunks)]
    xs = [torch.randn(chunk, dim, device="cuda").bfloat16() for _ in range(chunks)]
    fast = torch.zeros(vocab, dim, device="cuda")
    for g, x in zip(gs, xs):
        add_product_(fast, g.T, x)
    # The reference: each chunk's product from the same bf16 operands, exactly (fp64), summed in fp64.
    exact = sum(g.T.double() @ x.double() for g, x in zip(gs, xs))
    rounded = sum((g.T @ x).double() for g, x in zip(gs, xs))  # each product rounded to bf16, as on CPU
    # fp32 accumulation inside cuBLAS: ~1e-7 relative; a product rounded to bf16 first: ~1e-3.
    assert _rel(fast, exact) < 1e-5 < _rel(rounded, exact) / 10, (_rel(fast, exact), _rel(rounded, exact))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_compiled_adamw_on_cuda_computes_what_eager_does_and_writes_the_copies(state_dtype):
    import torch._dynamo.utils as dynamo_utils

    from trainlib.adamw import AdamW
    from trainlib.precision import keep_low_precision_copies

    def run(compile: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.LayerNorm(512), nn.Linear(512, 96, bias=False))
        model.cuda()
        copies = keep_low_precision_copies(model, torch.bfloat16)
        opt = AdamW([{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
                     {"params": list(model[1].parameters()), "weight_decay": 0.0}],
                    lr=1e-2, betas=(0.9, 0.95), state_dtype=state_dtype, compile=compile)
        opt.write_low_precision_copies(copies)
        copies.refresh()
        g = torch.Generator(device="cuda").manual_seed(1)
        for step in range(5):
            # Gradients that do not depend on the weights: a bf16 forward would amplify the last-bit differences
            # of two implementations into different trajectories within a few steps.
            for p in model.parameters():
                p.grad = torch.randn(p.shape, device="cuda", generator=g).to(p.dtype)
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1)
            opt.step()
            assert not copies.refresh()  # the step wrote every copy: nothing left to cast before a forward
            assert all(torch.equal(m.weight_lp, m.weight.detach().bfloat16()) for m in copies.linears)
        return [p.detach().clone() for p in model.parameters()]

    eager = run(False)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = run(True)
    for a, b in zip(eager, compiled):
        assert_same_update(b, a, state_dtype)
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 2, dynamo_utils.counters["stats"]


def test_weight_copies_under_a_compiled_block_give_autocasts_numbers():
    from trainlib.models.llama3 import Transformer, get_model_args
    from trainlib.precision import keep_low_precision_copies

    args = get_model_args("debug")
    grads = {}
    for copy in (True, False):
        torch.manual_seed(0)
        model = Transformer(args, rope_len=256).cuda()
        model.init_weights(seed=0)
        if copy:
            keep_low_precision_copies(model, torch.bfloat16)
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, fullgraph=True)
        tokens = torch.randint(0, args.vocab_size, (2, 256), device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(2))
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        grads[copy] = (loss.detach(), [p.grad for p in model.parameters()])
    (l1, g1), (l2, g2) = grads[True], grads[False]
    assert torch.equal(l1, l2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
