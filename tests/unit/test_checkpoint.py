"""Checkpoints: exact resume, crash during save, reshard on load, async saves.

Interruptions are real: the test hook TRAINLIB_FAULT_AT_STEP / _MID_SAVE
SIGKILLs rank 0 (see trainlib.checkpoint.manager._fault_hook), then the same
command is launched again and must continue from the last complete checkpoint.
"""






import pytest


def test_dataloader_state_under_incompatible_dp_is_a_clear_error():
    from trainlib.data import DataConfig, build_dataloader, build_tokenizer
    from trainlib.data.tokenizer import TokenizerConfig

    tok = build_tokenizer(TokenizerConfig(kind="byte"))
    a = build_dataloader(DataConfig(), tok, 16, 3, dp_rank=0, dp_world=1)
    next(a)
    b = build_dataloader(DataConfig(), tok, 16, 2, dp_rank=0, dp_world=1)
    with pytest.raises(ValueError, match="samples_consumed=3 is not a multiple"):
        b.load_state_dict(a.state_dict())


