"""Our exact LRU and our Belady ceiling against an independent simulator (libCacheSim)."""

from __future__ import annotations

import random

import libcachesim as lcs
import pytest
import torch
from helpers import small_pool

from ulakv.policies import ExactLRUModel
from ulakv.replay import belady_hits


def zipf_sequence(rng: random.Random, n_objects: int, length: int, skew: float = 1.1) -> list[int]:
    weights = [1 / (rank + 1) ** skew for rank in range(n_objects)]
    order = list(range(n_objects))
    rng.shuffle(order)
    return rng.choices(order, weights=weights, k=length)


def lcs_request(obj: int, next_access: int | None = None) -> lcs.Request:
    req = lcs.Request()
    req.obj_id, req.obj_size = obj, 1
    if next_access is not None:
        req.next_access_vtime = next_access
    return req


def test_exact_lru_matches_libcachesim_lru() -> None:
    """One access per round: the pool's hit/miss sequence equals libCacheSim's LRU, step by step.
    100 rounds of a Zipf trace over 23 objects and 7 GPU slots (each round a plan of the interpreted
    kernels); the model, which the pool matches step for step (test_policy_models.py,
    test_policy_machine.py), is held to libCacheSim on longer traces below."""
    seed, gpu, objects = 1, 7, 23
    pool = small_pool(gpu_slots=gpu, cpu_slots=objects, bytes_per_layer=4, num_layers=1, layers_per_group=1)
    seq = pool.admit(objects)
    pool.write(0, seq.addresses, torch.zeros((objects, 4), dtype=torch.uint8))
    addrs = seq.address_list
    oracle = lcs.LRU(cache_size=gpu)
    for a in addrs[:gpu]:  # the write homed the first `gpu` tokens on the GPU, in this order
        oracle.get(lcs_request(a))
    trace = zipf_sequence(random.Random(seed), objects, 100)
    for step, index in enumerate(trace):
        before = pool.stats()["hits"]
        pool.prepare(0, torch.tensor([[addrs[index]]]))
        hit = pool.stats()["hits"] - before == 1
        assert hit == oracle.get(lcs_request(addrs[index])), f"step {step}: address {addrs[index]}"


@pytest.mark.parametrize(("seed", "gpu", "objects"), [(0, 16, 60), (5, 7, 23), (6, 40, 300)])
def test_exact_lru_model_matches_libcachesim_lru(seed, gpu, objects) -> None:
    """The plain model over 3,000 rounds of one access each, hit for hit. (A round of several
    addresses protects its hits from its own misses, which an access-at-a-time cache does not.)"""
    model = ExactLRUModel(gpu)
    model.write(list(range(objects)), new=set(range(objects)))
    oracle = lcs.LRU(cache_size=gpu)
    for a in range(min(gpu, objects)):  # the write homed the first ``gpu`` addresses on the GPU
        oracle.get(lcs_request(a))
    for step, a in enumerate(zipf_sequence(random.Random(seed), objects, 3000)):
        hits, _, _ = model.prepare([a])
        assert (hits == [a]) == oracle.get(lcs_request(a)), f"round {step}: address {a}"


@pytest.mark.parametrize(("seed", "capacity"), [(2, 5), (3, 17), (4, 40)], ids=["c5", "c17", "c40"])
def test_belady_matches_libcachesim_belady(seed, capacity) -> None:
    trace = zipf_sequence(random.Random(seed), 80, 3000)
    following: dict[int, int] = {}
    next_access = [0] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        next_access[i] = following.get(trace[i], 2**63 - 1)
        following[trace[i]] = i
    oracle = lcs.Belady(cache_size=capacity)
    oracle_hits = sum(oracle.get(lcs_request(a, next_access[i])) for i, a in enumerate(trace))
    hits, misses = belady_hits([("select", [a]) for a in trace], capacity)
    assert (hits, misses) == (oracle_hits, len(trace) - oracle_hits)


def test_belady_keeps_a_round_whole_and_bypasses_useless_writes() -> None:
    # capacity 2: round {1, 2} must fit; the write of 3 (used later) displaces 1 (never used again).
    events = [("select", [1, 2]), ("write", [3, 4]), ("select", [2, 3]), ("select", [4])]
    assert belady_hits(events, 2) == (2, 3)
