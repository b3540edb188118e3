"""Your own training loop from trainlib's parts (about 50 lines).

    python docs/custom_loop.py                          # one process
    torchrun --nproc-per-node=2 docs/custom_loop.py     # FSDP over 2 ranks

Each part takes its own small config and can be used alone: swap the data,
the optimizer or the model for your own.
"""

import torch.distributed as dist

import trainlib

SEQ_LEN, GLOBAL_BATCH, STEPS = 128, 8, 20


def main() -> list[float]:
    cfg = trainlib.load_job_config(None, [f"--training.seq_len={SEQ_LEN}"])  # or a recipe: the debug model here
    info = trainlib.init_distributed(cfg.comm)
    try:
        return train(cfg, info)
    finally:
        # After train() returned, so its model and optimizer are gone: a process group they kept
        # alive past this call would keep gloo's threads running into the interpreter's exit,
        # which now and then aborts the process after a good run.
        trainlib.destroy_distributed()


def train(cfg: trainlib.JobConfig, info) -> list[float]:
    dims = trainlib.ParallelDims.from_config(cfg.parallelism, info.world_size)  # dp_shard=-1: FSDP over all ranks
    dims.build_mesh(info.device.type)

    # The job's own build: meta device, float8, pipeline split, parallelize (no memory until sharded).
    built = trainlib.build_model_parts(cfg, dims, info.device)
    (model,) = built.parts
    trainlib.init_model_weights(model, seed=0, device=info.device)

    optimizer = trainlib.build_optimizer([model], trainlib.OptimizerConfig(lr=3e-3))
    scheduler = trainlib.build_lr_scheduler(optimizer, trainlib.LRSchedulerConfig(warmup_steps=2), STEPS)
    dp_rank, dp_degree = dims.dp_coords()
    tokenizer = trainlib.build_tokenizer(trainlib.TokenizerConfig(kind="byte"))
    loader = trainlib.build_dataloader(trainlib.DataConfig(), tokenizer, SEQ_LEN, GLOBAL_BATCH // dp_degree,
                                       dp_rank, dp_degree, seed=0)
    losses = []
    for step in range(STEPS):
        batch = next(loader)
        n_targets = trainlib.count_targets(batch["labels"]).float()
        dist.all_reduce(n_targets)  # global token count: the loss is a mean over the whole batch
        # built.runner runs micro-batches under the layout (CP chunks, TP's loss context, autocast,
        # a pipeline schedule) with the loss as configured: by default (loss.chunked) the model stops
        # at the final norm and the loss applies the output projection chunk by chunk.
        loss, aux = built.runner.forward_backward([batch], n_targets)  # aux: an MoE router's values
        # optimizer=: a fused AdamW (on CUDA by default) then scales the gradients in its step.
        trainlib.clip_grad_norm_(model.parameters(), max_norm=1.0, optimizer=optimizer)
        optimizer.step()
        built.runner.after_optimizer_step()  # e.g. float8's next scales
        scheduler.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item())
        if info.rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    if info.rank == 0:
        print(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f})")
    return losses


if __name__ == "__main__":
    main()
