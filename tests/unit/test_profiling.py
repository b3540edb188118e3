"""Profiler windows, memory snapshots, and the garbage collector kept off the step."""

import contextlib
import gc
import importlib.util
import json
import pickle
import weakref
from pathlib import Path

import pytest
import torch

import trainlib.train as train_module
from tests.helpers import REPO
from trainlib.config import ConfigError, load_job_config
from trainlib.profiling import MEMORY_HISTORY_ENTRIES, GarbageCollection, Profiler, ProfilingConfig
from trainlib.train import train


def _cfg(tmp_path, *overrides):
    return load_job_config(None, [f"--job.dump_folder={tmp_path}", "--training.seq_len=32",
                                  "--training.global_batch_size=4", "--metrics.console=false", *overrides])


def _profiler_steps(trace):
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted(int(e["name"].split("#")[1]) for e in events if e.get("name", "").startswith("ProfilerStep#"))


def test_traces_hold_exactly_each_windows_active_steps(tmp_path):
    # windows end at steps 3 and 6; each records 2 steps after 1 warmup step; the third window is not traced
    train(_cfg(tmp_path, "--training.steps=9", "--profiling.enable_profiling=true", "--profiling.profile_freq=3",
               "--profiling.profile_warmup=1", "--profiling.profile_active=2", "--profiling.profile_windows=2",
               "--profiling.save_traces_folder=traces"))
    folders = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert folders == ["step-3", "step-6"]
    # ProfilerStep#i is the process's step i, training step i + 1
    assert _profiler_steps(tmp_path / "traces/step-3/rank0_trace.json") == [1, 2]
    assert _profiler_steps(tmp_path / "traces/step-6/rank0_trace.json") == [4, 5]


@pytest.mark.parametrize("warmup", [1, 3])
def test_the_schedule_warms_up_profile_warmup_steps_before_each_window(tmp_path, warmup):
    # The traces cannot show warm-up steps (nothing of them is kept): the schedule itself is checked.
    cfg = ProfilingConfig(profile_freq=6, profile_warmup=warmup, profile_active=2)
    actions = [Profiler(cfg, tmp_path, 0, torch.device("cpu"), start_step=0)._action(i) for i in range(6)]
    A = torch.profiler.ProfilerAction
    assert actions == [A.NONE] * (4 - warmup) + [A.WARMUP] * warmup + [A.RECORD, A.RECORD_AND_SAVE]


def test_profiling_window_must_fit_its_period():
    with pytest.raises(ValueError, match=r"profile_warmup \(3\) \+ profile_active \(2\) must fit in profile_freq \(4\)"):
        ProfilingConfig(profile_freq=4, profile_warmup=3, profile_active=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_memory_snapshot_on_cpu_is_a_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match=r"^profiling.enable_memory_snapshot records the CUDA caching allocator; "
                                          r"this job runs on cpu: set profiling.enable_memory_snapshot = false$"):
        train(_cfg(tmp_path, "--training.steps=1", "--profiling.enable_memory_snapshot=true"))


@pytest.mark.parametrize("enable", [True, False])
def test_memory_snapshot_step_and_folder_without_cuda(tmp_path, monkeypatch, enable):
    # The allocator's calls stubbed: when the Profiler records, where and when it dumps needs no CUDA.
    dumps, recording = [], []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: recording.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: (Path(path).touch(), dumps.append(path)))
    cfg = ProfilingConfig(enable_memory_snapshot=enable, memory_snapshot_step=3, save_memory_snapshot_folder="snaps")
    profiler = Profiler(cfg, tmp_path, 0, torch.device("cpu"), start_step=0)
    for step in (1, 2, 3, 4):
        profiler.step(step)
    profiler.dump_memory("oom_step5")  # what the loop does when a step runs out of memory
    profiler.close()
    if not enable:
        assert dumps == recording == []
        return
    assert dumps == [str(tmp_path / "snaps" / name) for name in ("rank0_step3.pickle", "rank0_oom_step5.pickle")]
    assert recording == [{"max_entries": MEMORY_HISTORY_ENTRIES}, {"enabled": None}]  # from setup to the end


def test_a_window_cut_short_by_the_end_of_training_is_written(tmp_path):
    train(_cfg(tmp_path, "--training.steps=2", "--profiling.enable_profiling=true", "--profiling.profile_freq=5",
               "--profiling.profile_warmup=0", "--profiling.profile_active=5"))
    # ProfilerStep#2: from the last step's end to the profiler's close.
    assert _profiler_steps(tmp_path / "profile_traces/step-2/rank0_trace.json") == [0, 1, 2]


@pytest.mark.parametrize("key,value,low", [("profile_freq", 0, 1), ("profile_warmup", -1, 0),
                                           ("profile_active", 0, 1), ("profile_windows", -1, 0),
                                           ("memory_snapshot_step", 0, 1)])
def test_profiling_counts_below_their_minimum_are_refused(key, value, low):
    with pytest.raises(ConfigError, match=rf"^profiling.{key} must be >= {low}, got {value}$"):
        ProfilingConfig(**{key: value})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_snapshot_at_the_chosen_step_on_cuda(tmp_path):
    train(_cfg(tmp_path, "--training.steps=3", "--job.device=cuda", "--profiling.enable_memory_snapshot=true",
               "--profiling.memory_snapshot_step=2"))
    (path,) = (tmp_path / "memory_snapshot").iterdir()
    assert path.name == "rank0_step2.pickle"
    snapshot = pickle.loads(path.read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]  # what memory_viz draws


# Python 3.12 starts with objects frozen (375 on 3.12.1) that gc.unfreeze() leaves; 0 on 3.10, 3.11, 3.13.
INTERPRETER_FROZEN = gc.get_freeze_count()


@contextlib.contextmanager
def _watch_gc(monkeypatch):
    """Record, at every step's forward-backward, whether automatic collection is on and whether
    objects are frozen; and count full (generation-2) collections while the loop runs."""
    seen, collections = [], []
    real = train_module.forward_backward

    def watched(*args):
        seen.append((gc.isenabled(), gc.get_freeze_count() > INTERPRETER_FROZEN))
        return real(*args)

    def count(phase, info):
        if phase == "start" and info["generation"] == 2 and seen:
            collections.append(len(seen))  # the step about to run (or just run)

    monkeypatch.setattr(train_module, "forward_backward", watched)
    gc.callbacks.append(count)
    try:
        yield seen, collections
    finally:
        gc.callbacks.remove(count)


def test_gc_is_off_during_training_with_a_collection_every_gc_freq_steps(tmp_path, monkeypatch):
    with _watch_gc(monkeypatch) as (seen, collections):
        train(_cfg(tmp_path, "--training.steps=6", "--training.gc_freq=2"))
    assert seen == [(False, True)] * 6
    assert collections[:3] == [1, 3, 5]  # before steps 2, 4, 6 (then train's own cleanup)
    assert gc.isenabled() and gc.get_freeze_count() == INTERPRETER_FROZEN  # restored


def test_gc_collects_setup_garbage_before_freezing_the_heap():
    class Node:
        pass

    cycle = Node()
    cycle.self, probe = cycle, weakref.ref(cycle)
    del cycle  # garbage only a collection frees; frozen uncollected, it would live for the whole run
    collector = GarbageCollection(gc_freq=5)
    try:
        assert probe() is None
    finally:
        collector.close()


def test_gc_freq_0_leaves_python_collection_automatic(tmp_path, monkeypatch):
    with _watch_gc(monkeypatch) as (seen, _):
        train(_cfg(tmp_path, "--training.steps=2", "--training.gc_freq=0"))
    assert seen == [(True, False)] * 2


def test_gc_jitter_script_reports_both_modes(capsys):
    spec = importlib.util.spec_from_file_location("gc_jitter", REPO / "scripts" / "gc_jitter.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--steps=4", "--gc-freq=2", "--training.seq_len=32", "--training.global_batch_size=4"]) == 0
    rows = [x.split() for x in capsys.readouterr().out.splitlines() if x.split() and x.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "2"]
    assert rows[1][rows[1].index("gen2") + 1] == "2"  # the scheduled ones, before steps 2 and 4


def test_a_step_out_of_memory_dumps_the_snapshot_named_by_its_step_and_still_fails(tmp_path, monkeypatch):
    """A resumed run (start step 2) whose first step runs out of memory: the dump is named for step 3."""
    ckpt = ["--checkpoint.enable=true", "--checkpoint.interval=2"]
    train(_cfg(tmp_path, "--training.steps=2", *ckpt))
    names = []
    monkeypatch.setattr(Profiler, "dump_memory", lambda self, name: names.append(name))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (injected)")

    monkeypatch.setattr(train_module, "forward_backward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        train(_cfg(tmp_path, "--training.steps=4", *ckpt))
    assert names == ["oom_step3"]
