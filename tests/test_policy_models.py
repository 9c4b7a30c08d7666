"""Invariant 7 and its PB-LRU twin: the pool makes the same hits, misses and victims as the plain
policy model, step for step, on traces with locality, speculative duplicates, new tokens, releases."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import random_rows, small_pool

from ulakv import PBLRU, ExactLRU
from ulakv.policies import ExactLRUModel, PBLRUModel

POLICIES = [
    ("exact-lru", ExactLRU(), lambda gpu: ExactLRUModel(gpu)),
    ("pblru4", PBLRU(4), lambda gpu: PBLRUModel(gpu, 4)),
]


def gpu_resident(pool, group: int, addrs: list[int]) -> set[int]:
    if not addrs:
        return set()
    slots = pool.residency(group, torch.tensor(addrs))
    return {a for a, s in zip(addrs, slots.tolist(), strict=True) if s >= 0}


@pytest.mark.parametrize(
    ("seed", "gpu", "cpu", "per_group"),
    [(1, 4, 12, 1), (2, 7, 20, 2), (4, 3, 30, 1)],
    ids=["g4-c12", "g7-c20-2layers", "g3-c30"],
)
@pytest.mark.parametrize(("policy", "model"), [p[1:] for p in POLICIES], ids=[p[0] for p in POLICIES])
def test_pool_matches_policy_model(seed, gpu, cpu, per_group, policy, model) -> None:
    pool = small_pool(gpu, cpu, bytes_per_layer=4, num_layers=2, layers_per_group=per_group, policy=policy)
    models = [model(gpu) for _ in range(pool.num_groups)]
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    seqs: list = []
    homed: set[tuple[int, int]] = set()  # (group, address) with a home
    for _ in range(30):
        live = [a for s in seqs for a in s.address_list]
        op = rng.random()
        if op < 0.25 and pool.free_addresses:
            seq = pool.admit(rng.randint(1, min(5, pool.free_addresses)))
            seqs.append(seq)
            for layer in range(2):
                group = pool.config.group_of(layer)
                before = gpu_resident(pool, group, live)
                new = {a for a in seq.address_list if (group, a) not in homed}
                on_gpu, victims = models[group].write(seq.address_list, new)
                pool.write(layer, seq.addresses, random_rows(gen, len(seq), 4))
                homed |= {(group, a) for a in seq.address_list}
                after = gpu_resident(pool, group, live + seq.address_list)
                assert before - after == set(victims)
                assert after == set(models[group].order)
                assert set(on_gpu) <= after
        elif op < 0.35 and seqs:
            seq = seqs.pop(rng.randrange(len(seqs)))
            pool.release(seq)
            for group, model in enumerate(models):
                model.release(seq.address_list)
                homed -= {(group, a) for a in seq.address_list}
        elif live:
            group = rng.randrange(pool.num_groups)
            # Locality: a recent window plus a few far positions; 3 query positions overlap.
            window = live[-rng.randint(1, gpu) :]
            picks = [*rng.sample(window, min(len(window), gpu - 1)), rng.choice(live)]
            picks = list(dict.fromkeys(picks))[:gpu]
            sel = torch.tensor([[rng.choice([*picks, -1]) for _ in range(4)] for _ in range(3)])
            before_stats = pool.stats()
            before = gpu_resident(pool, group, live)
            hits, misses, victims = models[group].prepare(sel.flatten().tolist())
            pool.prepare(group, sel.unsqueeze(0))
            stats = pool.stats()
            assert stats["hits"] - before_stats["hits"] == len(hits)
            assert stats["misses"] - before_stats["misses"] == len(misses)
            after = gpu_resident(pool, group, live)
            assert before - after == set(victims)
            assert after == set(models[group].order)
        pool.check_invariants()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda p: p.prepare([10, 99]), "InvalidAddressError", "never written"),
        (lambda p: p.write([99], new=set()), "InvalidAddressError", "neither written before nor in new"),
        (lambda p: p.release([10]), "InvalidInputError", "not one admitted batch"),
        (lambda p: p.release([77]), "InvalidInputError", "not one admitted batch"),
    ],
    ids=["prepare-unwritten", "write-unknown", "release-part-of-a-batch", "release-unknown"],
)
def test_pool_policy_refuses_a_trace_off_its_protocol_with_a_ulakv_error(call, error, words) -> None:
    """``PoolPolicy``'s protocol (its docstring): a ulakv error that says what to do, nothing changed."""
    import ulakv
    from ulakv.testing import PoolPolicy

    policy = PoolPolicy(ExactLRU(), gpu_slots=4)
    policy.write([10, 11, 12], new={10, 11, 12})
    before = policy.residents()
    with pytest.raises(getattr(ulakv, error), match=words):
        call(policy)
    assert policy.residents() == before
    policy.release([10, 11, 12])  # the batch is still whole and releasable
