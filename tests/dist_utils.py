"""Run a function on N gloo ranks in fresh processes (spawned, file-store rendezvous: no ports)."""

import os
import tempfile
import traceback

import torch.multiprocessing as mp


def _entry(rank, fn, world, store_path, err_dir, args):
    import torch.distributed as dist

    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        fn(rank, world, *args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world, *args, timeout=300):
    """fn(rank, world, *args) must be a module-level function. Raises with the
    first failing rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, os.path.join(tmp, "store"), tmp, args),
                                 nprocs=world, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=timeout):
                pass
        except Exception as e:
            errs = sorted(f for f in os.listdir(tmp) if f.endswith(".err"))
            detail = open(os.path.join(tmp, errs[0])).read() if errs else ""
            raise AssertionError(f"{e}\n{detail}") from None
