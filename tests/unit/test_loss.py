"""The chunked loss: the same loss and gradients as whole logits, without ever holding them."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainlib.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum, resolve_chunk_tokens
from trainlib.models.llama3 import Transformer, get_model_args


def _model(dtype, tie=False, vocab=512):
    model = Transformer(replace(get_model_args("debug", n_layers=2, vocab_size=vocab), tie_embeddings=tie), rope_len=32)
    model.init_weights(seed=0)
    return model.to(dtype)


def _loss_and_grads(model, tokens, labels, chunk_tokens):
    model.zero_grad(set_to_none=True)
    if chunk_tokens is None:
        model.output_in_forward = True
        loss = cross_entropy_sum(model(tokens), labels)
    else:
        model.output_in_forward = False
        loss = chunked_cross_entropy_sum(model(tokens), labels, output=model.output, chunk_tokens=chunk_tokens)
    (loss / 37).backward()  # a scale, as the loop's division by the global target count
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_matches_whole_logits(dtype, tol, tie):
    torch.manual_seed(0)
    model = _model(dtype, tie)
    tokens = torch.randint(0, 512, (3, 32))
    labels = torch.randint(0, 512, (3, 32))
    labels[1, 5:20] = IGNORE_INDEX  # padding-like targets are skipped the same way
    ref_loss, ref = _loss_and_grads(model, tokens, labels, None)
    for chunk in (7, 32, 96, 1000):  # uneven last chunk, one row, the whole batch, more than the batch
        loss, grads = _loss_and_grads(model, tokens, labels, chunk)
        torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=0)
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            assert (g - ref[name]).norm() <= tol * ref[name].norm(), (chunk, name)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tensor_as_large_as_the_logits():
    vocab, tokens = 4096, 4 * 32  # the logits and their gradient: 128 x 4096
    model = _model(torch.float32, vocab=vocab)
    x = torch.randint(0, vocab, (4, 32))
    for chunk, bound in ((None, None), (32, 32 * vocab)):
        model.output_in_forward = chunk is None
        with _LargestTensor() as seen:
            out = model(x)
            loss = cross_entropy_sum(out, x) if chunk is None else \
                chunked_cross_entropy_sum(out, x, output=model.output, chunk_tokens=chunk)
            loss.backward()
        if chunk is None:  # the check sees whole logits when they exist
            assert seen.numel == tokens * vocab
        else:
            assert seen.numel == max(bound, vocab * 64)  # a chunk's logits, or the output weight itself


def test_without_grad_it_only_computes_the_loss():
    model = _model(torch.float64)
    x = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        whole = cross_entropy_sum(model(x), x)
        model.output_in_forward = False
        chunked = chunked_cross_entropy_sum(model(x), x, output=model.output, chunk_tokens=5)
    assert not chunked.requires_grad
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)


def test_compiled_cross_entropy_is_used_per_chunk():
    calls = []
    model = _model(torch.float32)
    model.output_in_forward = False
    x = torch.randint(0, 512, (2, 32))
    ce = partial(lambda logits, labels: calls.append(logits.shape) or cross_entropy_sum(logits, labels))
    chunked_cross_entropy_sum(model(x), x, output=model.output, chunk_tokens=24, ce=ce).backward()
    assert calls == [(24, 512), (24, 512), (16, 512)]


def test_bf16_weight_gradient_rounds_like_whole_logits():
    """Under bf16 autocast, the output weight's gradient summed over 64 chunks
    is as close to an fp64 reference as the whole-logits matmul's (which rounds
    once): the running sum is fp32. A bf16 running sum was 4x as far off."""
    torch.manual_seed(0)
    vocab, shape = 1024, (64, 32)
    model = _model(torch.float32, vocab=vocab)
    ref = _model(torch.float64, vocab=vocab)
    ref.load_state_dict(model.state_dict())
    x = torch.randint(0, vocab, shape)
    _, want = _loss_and_grads(ref, x, x, None)
    err = {}
    for chunk in (None, 32):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, grads = _loss_and_grads(model, x, x, chunk)
        g, r = grads["output.weight"], want["output.weight"]
        assert g.dtype == torch.float32
        err[chunk] = float((g.double() - r).norm() / r.norm())
    assert err[32] <= 1.2 * err[None], err


def test_auto_chunk_is_small_on_cpu_and_large_on_cuda_within_a_logits_bound():
    assert resolve_chunk_tokens(300, "cuda", 128256) == 300  # a set value is kept
    assert resolve_chunk_tokens(0, "cpu", 128256) == 256
    assert resolve_chunk_tokens(0, "cuda", 128256) == 2048  # fp32 chunk logits 1.05e9 bytes <= 1 GiB
    assert resolve_chunk_tokens(0, "cuda", 128256 // 8) == 2048
    assert resolve_chunk_tokens(0, "cuda", 262144) == 1024
    assert resolve_chunk_tokens(0, "cuda", 10**7) == 256  # never below the CPU size


@pytest.mark.parametrize("loss_parallel,tokens", [(True, 2048), (False, 1024)])
def test_auto_chunk_sizes_to_this_ranks_vocabulary_share(loss_parallel, tokens):
    """Under TP loss parallelism a rank's chunk logits hold vocab / tp columns, so the chunk may be longer."""
    from trainlib.build import loss_chunk_tokens
    from trainlib.config import load_job_config

    cfg = load_job_config(None, [f"--parallelism.tp_loss_parallel={str(loss_parallel).lower()}"])
    assert loss_chunk_tokens(cfg, 262144, 2, "cuda") == tokens
