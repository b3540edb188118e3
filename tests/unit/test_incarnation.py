"""The store namespace that separates torchrun incarnations (trainlib.distributed.fresh_namespace).

Each test runs incarnations of W ranks as threads on one TCPStore, the way
torchrun's restarted workers share the agent's store, and leaves behind what a
death at some point of the handshake leaves. The live ranks must agree on one
name that no earlier incarnation used."""

import random
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from trainlib.distributed import _handshake_key, fresh_namespace

W = 4
TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def _incarnation(store, ranks=range(W), seed=0, timeout=TIMEOUT):
    """Live ranks `ranks` (of W) run the handshake at random moments: their
    names, and the store errors of those that gave up after `timeout`."""
    rng = random.Random(seed)
    names, errors = {}, []

    def worker(rank, delay):
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
        threading.Event().wait(delay)
        try:
            names[rank] = fresh_namespace(client, rank, W, timeout, poll_seconds=0.002)
        except dist.DistStoreError as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r, rng.uniform(0, 0.05))) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return names, errors


def test_every_live_rank_gets_one_fresh_name_per_incarnation(store):
    seen = set()
    for seed in range(5):
        names, errors = _incarnation(store, seed=seed)
        assert not errors and sorted(names) == list(range(W))
        (name,) = set(names.values())
        assert name not in seen
        seen.add(name)


@pytest.mark.parametrize("dead_at", ["before_hello", "after_hello", "after_ack"])
def test_a_rank_that_died_mid_handshake_does_not_split_the_next_incarnation(store, dead_at):
    """Incarnation 2 lost rank 2 at `dead_at`: rank 0 gave up waiting for it
    (ranks 1 and 3 had their answer, and would have died in gloo's
    connect). Incarnation 3 starts on everything both left. (Counting the
    workers that joined, the former scheme, splits incarnation 3 when a worker
    died before it was counted.)"""
    first, _ = _incarnation(store, seed=1)
    _, (gave_up,) = _incarnation(store, ranks=[0, 1, 3], seed=2, timeout=timedelta(seconds=0.5))
    assert "rank 0: ranks [2] did not confirm" in str(gave_up)
    if dead_at != "before_hello":
        store.set(_handshake_key("confirm", 2), "")
        store.set(_handshake_key("hello", 2), "token-of-a-dead-rank")
    if dead_at == "after_ack":
        store.set(_handshake_key("ack", 2) + "/token-of-a-dead-rank", "epoch-of-a-dead-rank-0")
    names, errors = _incarnation(store, seed=3)
    assert not errors and sorted(names) == list(range(W))
    (name,) = set(names.values())
    assert name != first[0]


def _client(store):
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)


def test_stale_keys_of_a_dead_rank_0_are_not_taken_for_a_live_epoch(store):
    """A previous incarnation's acks and confirmations are all in the store;
    until the new incarnation's rank 0 starts, no other rank may return (it
    would return the dead epoch)."""
    first, _ = _incarnation(store, seed=4)
    names = {}
    late = [threading.Thread(target=lambda r=r: names.__setitem__(r, fresh_namespace(_client(store), r, W, TIMEOUT,
                                                                                     0.002))) for r in range(1, W)]
    for t in late:
        t.start()
    threading.Event().wait(0.3)
    assert names == {}
    names[0] = fresh_namespace(store, 0, W, TIMEOUT, 0.002)
    for t in late:
        t.join(30)
    assert len(names) == W and set(names.values()) == {names[0]} and names[0] != first[0]


def test_a_rank_that_never_confirms_ends_in_a_store_error_naming_it(store):
    store.set(_handshake_key("hello", 2), "token-of-a-dead-rank")  # what a dead rank 2 left
    rank1 = threading.Thread(target=fresh_namespace, args=(_client(store), 1, 3, TIMEOUT, 0.002))
    rank1.start()
    with pytest.raises(dist.DistStoreError, match=r"rank 0: ranks \[2\] did not confirm within"):
        fresh_namespace(store, 0, 3, timedelta(seconds=1), 0.002)
    rank1.join(30)


def test_without_rank_0_a_rank_ends_in_a_store_error_saying_so(store):
    _incarnation(store, seed=5)  # acks and an epoch of a dead rank 0 are in the store
    with pytest.raises(dist.DistStoreError, match=r"rank 1: no answer from rank 0 within 0:00:01"):
        fresh_namespace(_client(store), 1, W, timedelta(seconds=1))
