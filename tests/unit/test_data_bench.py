"""The prepared loader's scaling claims, measured by scripts/data_bench.py at a small scale
(docs/data.md has the full-size numbers). Bounds are loose: this runs on shared 2-core machines."""

import gc
import importlib.util
import shutil

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("data_bench", REPO / "scripts" / "data_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def corpora(bench, tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    bench.write_synthetic(str(small), 8 << 20, shard_tokens=1 << 22)  # 16 MiB of uint16 tokens, 2 shards
    bench.write_synthetic(str(big), 80 << 20, shard_tokens=1 << 25)  # 160 MiB, 3 shards
    yield str(small), str(big)
    shutil.rmtree(tmp_path)  # do not leave 176 MiB in pytest's kept temp folders


def _rss_mib():
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["VmRSS"].split()[0]) / 1024


def test_rank_cost_flat_in_dp_degree_resume_o1_memory_flat_in_corpus(bench, corpora):
    small, big = corpora
    # one rank's throughput at dp_world 1..512 (a loader that read other ranks' samples would
    # be ~512x slower at the top)
    tps = bench.loader_throughput(big, seq_len=512, batch=8, steps=100, rounds=3)
    assert max(tps.values()) / min(tps.values()) < 3.0, tps
    # resume at sample 10**6 costs what resume at 0 does (no re-reading)
    t = bench.resume_times(big, (0, 10**6), seq_len=512, batch=8, repeats=5)
    assert t[10**6] < 2 * t[0] + 0.01, t
    # memory of a rank after 100 shuffled steps: the same for a corpus 10x larger
    deltas = {}
    for folder in (small, big):
        gc.collect()
        before = _rss_mib()
        dl = bench._loader(folder, 2048, 8, 3, 8, shuffle=True, prefetch=2)
        for _ in range(100):
            next(dl)
        deltas[folder] = _rss_mib() - before
        dl.close()
        del dl
    assert deltas[big] - deltas[small] < 32, deltas  # the big corpus alone is 160 MiB
