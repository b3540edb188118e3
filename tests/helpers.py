"""Shared test helpers: paths, the real CLI, and gloo ranks in fresh processes.

Imported as `from tests.helpers import ...` everywhere (pytest puts the repo
root on sys.path, see pyproject.toml), so plain `pytest` and `python -m pytest`
collect the same way.
"""

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import weakref
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from multiprocessing.connection import wait as wait_for
from torch.utils._python_dispatch import TorchDispatchMode

from trainlib import compat
from trainlib.launch import train_command

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
FAULTS = REPO / "tests" / "faults"


def fault_env(marker_dir, *faults: str) -> dict:
    """Environment that makes a subprocess run inject `faults` (specs
    "POINT:STEP[:RANK[:ACTION]]", see tests/faults/sitecustomize.py), each once
    over all launches sharing `marker_dir`."""
    Path(marker_dir).mkdir(parents=True, exist_ok=True)
    return {"TRAINLIB_FAULTS": ",".join(faults), "TRAINLIB_FAULT_DIR": str(marker_dir),
            "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"}


def run_cli(args, nproc=1, timeout=600, cwd=None, env=None):
    """Run the real CLI (torchrun for nproc > 1), with `env` added to the
    environment. Returns CompletedProcess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return run_tree(train_command(nproc, args), timeout, cwd=cwd or REPO, env=env)


def run_tree(cmd: list, timeout: float, **popen_kw) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, except
    that a timeout kills every process below `cmd` too (`kill_tree`), torchrun's
    workers included, which subprocess.run's kill of torchrun alone leaves running."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kw)
    ((out, err),) = communicate_all([proc], timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple]:
    """`communicate()` with each of `procs` in turn, `timeout` seconds each;
    (stdout, stderr) per process. On a timeout or an interrupt every one of
    them is killed with all its descendants (`kill_tree`), then it re-raises."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    except BaseException:
        for p in procs:
            kill_tree(p)
        raise


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it. torchrun starts its workers
    in sessions of their own, so killing torchrun alone (what a timeout does)
    would leave them running: a hung rank sleeps on, holding its memory."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
    below, todo = [], [proc.pid]
    while todo:
        kids = children.get(todo.pop(), [])
        below += kids
        todo += kids
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def cxx_compiler_problem() -> str | None:
    """Why torch.compile cannot build its CPU kernels here, or None when it can:
    inductor compiles C++ at run time with $CXX (default g++; clang++ on macOS),
    and the kernels include Python.h."""
    cxx = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
    include = sysconfig.get_paths()["include"]
    if shutil.which(cxx) is None:
        return f"torch.compile on CPU needs a C++ compiler: {cxx} not found (install g++, or set CXX)"
    if not Path(include, "Python.h").is_file():
        return (f"torch.compile on CPU needs the Python headers: no Python.h in {include} "
                f"(install python3-dev, or python3.X-dev for your Python)")
    return None


needs_cxx_compiler = pytest.mark.skipif(cxx_compiler_problem() is not None, reason=cxx_compiler_problem() or "")


def _cuda_problem(min_capability: tuple[int, int] | None = None) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA device; none is visible to torch {torch.__version__}"
    cap = torch.cuda.get_device_capability()
    if min_capability and cap < min_capability:
        return (f"needs CUDA compute capability >= {min_capability[0]}.{min_capability[1]} (float8 matmuls); "
                f"{torch.cuda.get_device_name()} is {cap[0]}.{cap[1]}")
    return None


needs_cuda = pytest.mark.skipif(_cuda_problem() is not None, reason=_cuda_problem() or "")
needs_float8_gpu = pytest.mark.skipif(_cuda_problem((8, 9)) is not None, reason=_cuda_problem((8, 9)) or "")


def build_on_one_rank(cfg):
    """trainlib.build.build_model_parts for a world of one (CPU, its own process group, destroyed after)."""
    from trainlib.build import build_model_parts
    from trainlib.distributed import destroy_distributed, init_distributed
    from trainlib.parallel import ParallelDims

    init_distributed(cfg.comm)
    try:
        dims = ParallelDims.from_config(cfg.parallelism, 1)
        dims.build_mesh("cpu")
        return build_model_parts(cfg, dims, torch.device("cpu"))
    finally:
        destroy_distributed()


def build_debug(dims, overrides: list[str]):
    """(config, Built) of the debug recipe with `overrides`, built on `dims`' mesh (already built) with
    every model part's weights initialized from seed 0: the start of each real-step byte check."""
    from trainlib.build import build_model_parts
    from trainlib.config import load_job_config
    from trainlib.parallel import init_model_weights

    cfg = load_job_config(str(RECIPES / "debug.toml"), overrides)
    built = build_model_parts(cfg, dims, torch.device("cpu"))
    for part in built.parts:
        init_model_weights(part, 0, "cpu")
    return cfg, built


def gloo_schedules() -> list[str]:
    """The pipeline schedules that run on gloo with the installed torch and the
    default (chunked) loss. Before torch 2.13 the V placements do not, nor the
    zero-bubble schedules with the chunked loss (trainlib.parallel.pp)."""
    from trainlib.parallel import pp

    return [s for s in pp.SCHEDULES if (compat.V_SCHEDULES_ON_GLOO or s not in pp.V_SCHEDULES)
            and (compat.ZERO_BUBBLE_WITH_CHUNKED_LOSS or s not in pp.ZERO_BUBBLE_SCHEDULES)]


def _run_rank(rank, fn, world, store_path, args):
    import torch.distributed as dist

    from trainlib.distributed import destroy_distributed

    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        fn(rank, world, *args)
        # A daemon thread inside a torch call when the interpreter exits aborts the rank ("terminate
        # called without an active exception"), now and then: fail every time instead.
        left = [t.name for t in threading.enumerate() if t.name.startswith("trainlib-")]
        if left:
            raise AssertionError(f"rank {rank} left threads running: {left} (trainlib.train.Job.close)")
    finally:
        # Frees what fn built (pipeline stages and meshes sit in reference cycles) while the
        # process groups exist: freed after them, a rank aborted at exit now and then ("terminate
        # called without an active exception", 1 in 8 and 3 in 16 runs of
        # test_init_matches_single_process; 0 in 20 with the collection first).
        destroy_distributed()


def _entry(rank, fn, world, store_path, err_dir, args):
    try:
        _run_rank(rank, fn, world, store_path, args)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def _serve(conn):
    """A long-lived gloo rank (GlooWorkers): runs (fn, world, rank, store, args) jobs until its pipe
    closes, answering None or the job's traceback."""
    while True:
        try:
            rank, fn, world, store_path, args = conn.recv()
        except EOFError:
            os._exit(0)  # no interpreter finalization with gloo's threads about (trainlib.train does the same)
        env = dict(os.environ)
        try:
            _run_rank(rank, fn, world, store_path, args)
            conn.send(None)
        except BaseException:
            conn.send(traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(env)


class GlooWorkers:
    """Ranks that outlive a test: `spawn` runs each test's ranks in them, so the suite pays a rank's
    start-up (Python, torch, trainlib: seconds of CPU each) once rather than per test. Every job still
    gets a process group of its own (a fresh file store) and destroys it; a job that fails or hangs
    costs the workers (they are killed and started again on the next job)."""

    JOBS_PER_WORKER = 25  # gloo keeps a destroyed group's threads and sockets: recycle, as WorkerPool does

    def __init__(self):
        self._procs, self._conns, self._jobs = [], [], 0

    def close(self):
        self._jobs = 0
        for c in self._conns:
            c.close()
        for p in self._procs:
            p.kill()
            p.join()
        self._procs, self._conns = [], []

    def run(self, fn, world, args, timeout):
        if any(not p.is_alive() for p in self._procs) or self._jobs >= self.JOBS_PER_WORKER:
            self.close()
        self._jobs += 1
        ctx = mp.get_context("spawn")
        while len(self._procs) < world:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,))  # not daemonic: a job may start processes
            p.start()
            theirs.close()
            self._procs.append(p)
            self._conns.append(mine)
        with tempfile.TemporaryDirectory() as tmp:
            for rank in range(world):
                self._conns[rank].send((rank, fn, world, os.path.join(tmp, "store"), args))
            errors, pending, deadline = {}, dict(enumerate(self._conns[:world])), time.monotonic() + timeout
            while pending:
                ready = wait_for(list(pending.values()), max(0.0, deadline - time.monotonic()))
                if not ready:
                    errors.update((r, f"no answer within {timeout} s") for r in pending)
                    break
                for rank in [r for r, c in pending.items() if c in ready]:
                    try:
                        answer = pending.pop(rank).recv()
                    except EOFError:
                        answer = f"its process died (exit code {self._procs[rank].exitcode})"
                    if answer is not None:
                        errors[rank] = answer
                        deadline = min(deadline, time.monotonic() + 30)  # the others may wait on it
        if errors:
            self.close()  # a failed job can leave a worker stuck in a collective or a half-torn group
            rank = min(errors)
            raise AssertionError(f"rank {rank} of {world} failed:\n{errors[rank]}")


GLOO_WORKERS = GlooWorkers()


def spawn(fn, world, *args, timeout=300, fresh=False):
    """Run fn(rank, world, *args) on `world` gloo ranks (file-store rendezvous: no ports). fn must be a
    module-level function. Raises with the first failing rank's traceback. The ranks are the session's
    long-lived GlooWorkers unless `fresh` (a test of signals, timeouts or exits: processes of its own)."""
    if not fresh:
        GLOO_WORKERS.run(fn, world, args, timeout)
        return
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


class BytesSent(TorchDispatchMode):
    """The collectives this rank runs while active, by kind (`counts`: "all_gather", "reduce_scatter",
    "all_reduce", "send", "all_to_all"), and the bytes it sends in them as ring algorithms over `n` ranks send them
    (`bytes`; per kind in `bytes_by_kind`): the traced functional ops (TP's redistributions), the in-place
    c10d ones (FSDP's, CP's) and point-to-point sends (PP's). Not seen: what DTensor runs inside an
    operator's own dispatch (loss parallelism's reductions of per-token scalars). `keep(input tensor)`
    selects which collectives count."""

    # op name: (kind, index of the input tensor, bytes sent per input byte over n ranks)
    OPS = {
        ("_c10d_functional", "all_gather_into_tensor"): ("all_gather", 0, lambda n: n - 1),  # input: the shard
        ("_c10d_functional", "reduce_scatter_tensor"): ("reduce_scatter", 0, lambda n: (n - 1) / n),
        ("_c10d_functional", "all_reduce"): ("all_reduce", 0, lambda n: 2 * (n - 1) / n),
        ("c10d", "_allgather_base_"): ("all_gather", 1, lambda n: n - 1),  # (output, input)
        ("c10d", "_reduce_scatter_base_"): ("reduce_scatter", 1, lambda n: (n - 1) / n),
        ("c10d", "allreduce_"): ("all_reduce", 0, lambda n: 2 * (n - 1) / n),  # ([tensor], ...): HSDP
        ("c10d", "send"): ("send", 0, lambda n: 1),  # ([tensor], ...): pipeline stages
        ("c10d", "alltoall_base_"): ("all_to_all", 1, lambda n: (n - 1) / n),  # (output, input): Ulysses CP
    }

    def __init__(self, n: int, keep=lambda t: True):
        super().__init__()
        self.n, self.keep = n, keep
        self.counts, self.bytes_by_kind = {}, {}

    @property
    def bytes(self) -> float:
        return sum(self.bytes_by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = self.OPS.get((func.namespace, func.__name__.split(".")[0]))
        if known is not None:
            kind, i, per_byte = known
            t = args[i][0] if isinstance(args[i], (list, tuple)) else args[i]
            if self.keep(t):
                self.counts[kind] = self.counts.get(kind, 0) + 1
                sent = t.numel() * t.element_size() * per_byte(self.n)
                self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0.0) + sent
        return func(*args, **(kwargs or {}))


class NewTensors(TorchDispatchMode):
    """Every floating-point tensor an op makes in new memory while active (views and in-place results
    left out): `made` holds (op name, shape), `alive_before` how many of the earlier ones were still
    alive when each was made."""

    def __init__(self):
        super().__init__()
        self.made, self.alive_before, self._refs = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if (isinstance(out, torch.Tensor) and out.is_floating_point() and not out.is_meta  # meta: no memory
                and out.untyped_storage().data_ptr() not in inputs):
            self.alive_before.append(sum(ref() is not None for ref in self._refs))
            self.made.append((str(func), tuple(out.shape)))
            self._refs.append(weakref.ref(out))
        return out


def sgd_losses(model, tokens, steps: int = 5, lr: float = 0.5) -> list[float]:
    """`steps` SGD steps of next-token cross-entropy on one batch of `tokens` [b, s + 1]: the losses (a model
    that learns lowers them; the gradients are left on the parameters)."""
    import torch.nn.functional as F

    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


def doc_ids_from_starts(starts: list[list[int]], seq_len: int):
    """[b, seq_len] document ids from each row's document start positions (0 first)."""
    import torch

    ids = torch.zeros(len(starts), seq_len, dtype=torch.long)
    for row, row_starts in zip(ids, starts):
        for s in row_starts[1:]:
            row[s:] += 1
    return ids


def per_document_attention(q, k, v, doc_ids):
    """Document-causal attention the plain way, as a reference: for every row and
    every document, causal softmax attention over that document's positions alone.
    q: [b, h, S, d]; k, v: [b, h_kv, S, d] (h_kv divides h); doc_ids: [b, S]."""
    import math

    import torch

    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    rows = []
    for qr, kr, vr, docs in zip(q, k, v, doc_ids):
        out = torch.zeros_like(qr)
        for doc in docs.unique():
            idx = (docs == doc).nonzero().flatten()
            scores = qr[:, idx] @ kr[:, idx].transpose(-1, -2) / math.sqrt(q.shape[-1])
            future = torch.ones(len(idx), len(idx), dtype=torch.bool).triu(1)
            out[:, idx] = scores.masked_fill(future, -math.inf).softmax(-1) @ vr[:, idx]
        rows.append(out)
    return torch.stack(rows)


def short_documents_corpus(path, n_docs: int = 600, seed: int = 0):
    """A jsonl corpus of short documents (3-40 words, ~110 bytes on average), so that
    a byte-tokenized window of a few hundred tokens holds several documents."""
    import json
    import random

    rng = random.Random(seed)
    words = ("the of and to in that is was he for it with as his on be at by this had not are but from or have "
             "an they which one you were her all she there would their we him been has when who will more no if "
             "out so said what up its about into than them can only other new some could time these two may").split()
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))}) + "\n")
    return path


def fake_streaming_hub(monkeypatch, docs) -> list:
    """`datasets.load_dataset` answers with a local streaming dataset of `docs`
    (no hub); returns the list of (name, subset, split, streaming) it was
    called with."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(name, subset=None, split=None, streaming=False, **kw):
        calls.append((name, subset, split, streaming))
        return datasets.IterableDataset.from_generator(lambda: iter([{"text": d} for d in docs]))

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def global_batches(loaders, steps):
    """Concatenate the micro-batches of all DP ranks for each step."""
    out = []
    for _ in range(steps):
        parts = [next(dl) for dl in loaders]
        out.append({k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return out
