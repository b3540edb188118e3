"""Validation in-process: what it scores, how often, and that training does not notice it."""

import math

import pytest
import torch
import torch.nn.functional as F

from trainlib.config import load_job_config
from trainlib.data import DEFAULT_VALIDATION_PATH, DataConfig, build_dataloader, build_tokenizer, document_ids
from trainlib.distributed import destroy_distributed, init_distributed
from trainlib.train import setup, train
from trainlib.validation import ValidationConfig, Validator


def _cfg(tmp_path, *overrides):
    return load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.seq_len=64",
                                  "--training.global_batch_size=8", "--metrics.log_freq=1", "--metrics.console=false",
                                  "--validation.steps=3", *overrides])


@pytest.mark.parametrize("mask", ["causal", "document"])
def test_validation_is_the_token_mean_loss_of_its_data_from_the_start_each_time(tmp_path, mask):
    # causal: the default data, the shipped corpus's held-out chapters; document: short documents,
    # so that windows hold several and the mask matters
    path = DEFAULT_VALIDATION_PATH
    if mask == "document":
        path = str(tmp_path / "short.jsonl")
        (tmp_path / "short.jsonl").write_text("".join(f'{{"text": "verse {i}: {"and it was so " * (i % 5)}"}}\n'
                                                      for i in range(400)))
    cfg = _cfg(tmp_path, "--validation.enable=true", "--training.local_batch_size=4",  # 2 micro-batches a step
               f"--model.attn_mask={mask}", *([f"--validation.data.path={path}"] if mask == "document" else []))
    job = setup(cfg, init_distributed(cfg.comm, cfg.job.device))
    try:
        first, again = job.validator.run(), job.validator.run()
        assert list(job.validator.loader.tokens_seen_per_dataset()) == [path]
        (model,) = job.model_parts
        loader = build_dataloader(DataConfig(path=path), build_tokenizer(cfg.tokenizer), 64, 24)
        batch = next(loader)  # the 3 validation batches of 8 sequences, at once
        doc_ids = document_ids(batch["position_ids"]) if mask == "document" else None
        assert not model.output_in_forward  # loss.chunked (the default): the forward ends at the final norm
        logits = model.output(model(batch["input"], doc_ids=doc_ids))
        expected = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        causal = F.cross_entropy(model.output(model(batch["input"])).flatten(0, 1), batch["labels"].flatten())
    finally:
        job.close()
        destroy_distributed()
    assert first == again  # restarts at the beginning: the same tokens every time
    assert math.isclose(first["val_loss"], expected.item(), rel_tol=1e-6)
    assert (mask == "document") == (expected != causal).item()  # the mask is applied, and it matters here
    assert first["val_perplexity"] == math.exp(first["val_loss"])


def test_validation_runs_every_interval_and_at_the_last_step_without_moving_the_curve(tmp_path):
    plain = train(_cfg(tmp_path / "plain", "--training.steps=5"))
    validated = train(_cfg(tmp_path / "val", "--training.steps=5", "--validation.enable=true",
                           "--validation.interval=2"))
    assert [r["step"] for r in validated if "val_loss" in r] == [2, 4, 5]
    # == on floats: same data position, RNG, weights and optimizer state, to the last bit
    assert [(r["loss"], r["grad_norm"]) for r in validated] == [(r["loss"], r["grad_norm"]) for r in plain]


def test_validation_keys_are_checked():
    with pytest.raises(ValueError, match="validation.interval must be >= 1, got 0"):
        ValidationConfig(interval=0)


def test_validation_computes_in_bf16_where_training_uses_autocast(tmp_path):
    # One rank with bfloat16 params trains under autocast over fp32 weights (training.mixed_precision_impl
    # auto); validation must score the same bf16 computation, not the fp32 weights.
    cfg = _cfg(tmp_path, "--validation.enable=true", "--training.mixed_precision_param=bfloat16")
    job = setup(cfg, init_distributed(cfg.comm, cfg.job.device))
    try:
        assert job.runner.autocast_dtype == torch.bfloat16
        (model,) = job.model_parts
        modes = []
        hook = model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
        bf16 = job.validator.run()["val_loss"]
        hook.remove()
        # scored in eval mode, and training goes on in train mode (a dropout or a router would notice)
        assert modes and not any(modes) and all(m.training for m in model.modules())
        job.runner.autocast_dtype = None
        fp32 = job.validator.run()["val_loss"]
    finally:
        job.close()
        destroy_distributed()
    assert bf16 != fp32 and math.isclose(bf16, fp32, rel_tol=1e-2), (bf16, fp32)


def test_close_stops_the_validation_loader():
    # Job.close reaches a prepared loader's prefetch thread only through Validator.close; the thread can
    # abort the process at exit if left running.
    class Loader:
        closed = False

        def state_dict(self):
            return {}

        def close(self):
            self.closed = True

    def validator(loader):
        return Validator(ValidationConfig(enable=loader is not None), loader, None, micro_batches=1)

    loader = Loader()
    validator(loader).close()
    assert loader.closed
    validator(None).close()  # validation off: no loader, nothing to stop
