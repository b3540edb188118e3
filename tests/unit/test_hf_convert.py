"""Hugging Face interop: logits match transformers after import and after export."""

import json

import pytest
import torch

from trainlib.models.llama3 import Transformer  # noqa: E402


def test_convert_cli_errors_are_one_line(tmp_path, capsys):
    from trainlib.convert import main

    assert main(["dcp-to-hf", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "not a complete DCP checkpoint" in capsys.readouterr().err
    assert main(["hf-to-dcp", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not a Hugging Face checkpoint folder" in capsys.readouterr().err


def test_meta_consolidated_pth_loads_into_a_model(tmp_path):
    """Meta's reference format uses trainlib's own names and rotary layout."""
    from trainlib.checkpoint.hf import load_meta_into_model
    from trainlib.models.llama3 import get_model_args

    args = get_model_args("debug")
    src = Transformer(args, rope_len=32)
    src.init_weights(seed=5)
    sd = {k: v for k, v in src.state_dict().items()}
    torch.save(sd, tmp_path / "consolidated.00.pth")
    (tmp_path / "params.json").write_text(json.dumps({"dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}))
    dst = Transformer(args, rope_len=32)
    dst.init_weights(seed=6)
    load_meta_into_model([dst], tmp_path, args)
    tokens = torch.randint(0, args.vocab_size, (1, 32))
    with torch.no_grad():
        assert torch.equal(dst(tokens), src(tokens))
    with pytest.raises(ValueError, match="n_layers=2"):
        load_meta_into_model([dst], tmp_path, get_model_args("debug", n_layers=2))


