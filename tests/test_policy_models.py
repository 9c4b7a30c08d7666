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
    [(1, 4, 12, 1), (2, 7, 20, 2)],
    ids=["g4-c12", "g7-c20-2layers"],
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


def protocol_policies():
    """Every policy of the kit, fresh, with one admitted batch [10, 11, 12] of 4 GPU slots."""
    from ulakv.testing import PoolPolicy

    made = {
        "PoolPolicy-lru": PoolPolicy(ExactLRU(), gpu_slots=4),
        "PoolPolicy-pblru": PoolPolicy(PBLRU(3), gpu_slots=4),
        "ExactLRUModel": ExactLRUModel(4),
        "PBLRUModel": PBLRUModel(4, 3),
    }
    for policy in made.values():
        policy.write([10, 11, 12], new={10, 11, 12})
    return made


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda p: p.prepare([10, 99]), "InvalidAddressError", "never written"),
        (lambda p: p.prepare([10, -7]), "InvalidAddressError", "ints >= 0"),
        (lambda p: p.prepare([10, 2.0]), "InvalidAddressError", "ints >= 0"),
        (lambda p: p.prepare([10, 11, 12, 13, 14]), "InvalidAddressError", "never written"),
        (lambda p: p.write([99], new=set()), "InvalidAddressError", "neither written before nor in new"),
        (lambda p: p.write([10, 13], new={10, 13}), "InvalidAddressError", "admitted before"),
        (
            lambda p: p.write([13], new={13, 14}),
            "InvalidInputError",
            "new names addresses the write does not",
        ),
        (lambda p: p.release([10]), "InvalidInputError", "not one admitted batch"),
        (lambda p: p.release([10, 11, 12, 12]), "InvalidInputError", "not one admitted batch"),
        (lambda p: p.release([77]), "InvalidInputError", "not one admitted batch"),
        (lambda p: p.release([]), "InvalidInputError", "not one admitted batch"),
    ],
    ids=[
        "prepare-unwritten",
        "prepare-negative",
        "prepare-float",
        "prepare-unwritten-and-too-many",
        "write-unknown",
        "write-new-again",
        "write-new-not-written",
        "release-part-of-a-batch",
        "release-a-repeat",
        "release-unknown",
        "release-nothing",
    ],
)
def test_every_policy_refuses_a_trace_off_the_protocol_alike(call, error, words) -> None:
    """The protocol (``ulakv.policies.protocol``): the models and the kernels refuse the same call
    with the same ulakv error and the same words, and each is left as it was (the batch still whole
    and releasable)."""
    import ulakv

    messages = {}
    for name, policy in protocol_policies().items():
        before = policy.residents()
        with pytest.raises(getattr(ulakv, error), match=words) as refused:
            call(policy)
        messages[name] = str(refused.value).replace(type(policy).__name__, "<policy>")
        assert policy.residents() == before, name
        policy.prepare([10, 12])
        policy.release([12, 11, 10])
        assert policy.residents() == set(), name
    assert len(set(messages.values())) == 1, messages


def test_every_policy_refuses_a_selection_over_its_gpu_slots_alike() -> None:
    import ulakv

    messages = set()
    for policy in protocol_policies().values():
        policy.write([13, 14], new={13, 14})
        with pytest.raises(ulakv.CapacityError, match="more than the 4 GPU slots") as refused:
            policy.prepare([10, 11, 12, 13, 14, -1])
        messages.add(str(refused.value).replace(type(policy).__name__, "<policy>"))
    assert len(messages) == 1


def test_every_policy_takes_the_same_trace_and_decides_alike() -> None:
    """One trace on the protocol, with padding, repeats, a write of old and new, a release: the
    models decide what the pool's kernels decide."""
    trace = [
        ("write", [0, 1, 2], {0, 1, 2}),
        ("prepare", [2, 0, -1, 2]),
        ("write", [3, 1, 4, -1], {3, 4}),
        ("prepare", [4, 1, 3]),
        ("release", [2, 1, 0]),
        ("write", [5, 6, 7], {5, 6, 7}),
        ("prepare", [3, 7, 5, 4]),
        ("release", [4, 3]),
        ("prepare", [6, -1]),
    ]
    by_policy = {}
    for name, policy in protocol_policies().items():
        policy.release([10, 11, 12])
        results = []
        for call, *args in trace:
            results.append((getattr(policy, call)(*args), sorted(policy.residents())))
        by_policy[name] = results
    assert by_policy["PoolPolicy-lru"] == by_policy["ExactLRUModel"]
    assert by_policy["PoolPolicy-pblru"] == by_policy["PBLRUModel"]
