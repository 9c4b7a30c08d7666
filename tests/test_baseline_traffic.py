"""The two baselines under seeded random traffic, against the model of ``tests/baseline_harness.py``.

Both are comparison points, so they must be as correct as ulakv's own layouts (``docs/design.md``,
section 4): nothing lost, bit for bit (invariant 2), every selected entry on the GPU holding its
bytes (3), the counters and the ratio the comparisons quote exactly those of the model (1), refused
calls changing nothing (8), and release returning everything: a pool whose requests all left
behaves as a fresh pool (6). The harness checks all of it after every call.

Pools are tiny and oddly sized (12-, 20- and 5-byte rows, 3 or 5 layers in groups of 2 so the last
group is short, quotas of 2..4): kernels run under the Triton interpreter on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from baseline_harness import Harness, random_step
from helpers import (
    STAT_COUNTERS,
    assert_same_state,
    looking_behind_reset,
    offload_config,
    random_rows,
    replicated_config,
)

from ulakv import Pool, PoolConfig

# 3 or 5 layers in groups of 2 leave the last group short; 5-byte rows are no whole number of 4-byte
# words, so the kernels move them byte by byte; one layer a group makes every layer its own group.
TRAFFIC_CASES = [
    (
        "offload-quota-3-of-2-requests-last-group-short",
        offload_config(cpu=17, quota=3, requests=2, bpl=12, layers=3, lpg=2),
    ),
    (
        "offload-quota-4-of-3-requests-5-layers-20-byte-rows",
        offload_config(cpu=23, quota=4, requests=3, bpl=20, layers=5, lpg=2),
    ),
    (
        "offload-quota-2-one-request-5-byte-rows-moved-bytewise",
        offload_config(cpu=9, quota=2, requests=1, bpl=5, layers=2, lpg=1),
    ),
    ("replicated-world-3-last-group-short", replicated_config(world=3, gpu=13, bpl=12, layers=3, lpg=2)),
    ("replicated-world-8-5-layers-20-byte-rows", replicated_config(world=8, gpu=11, bpl=20, layers=5, lpg=2)),
    (
        "replicated-world-1-5-byte-rows-moved-bytewise",
        replicated_config(world=1, gpu=9, bpl=5, layers=2, lpg=1),
    ),
]


@pytest.mark.parametrize(
    ("cfg", "seed"), [(c[1], i) for i, c in enumerate(TRAFFIC_CASES)], ids=[c[0] for c in TRAFFIC_CASES]
)
def test_random_traffic_is_bit_exact(cfg: PoolConfig, seed: int) -> None:
    rng = random.Random(seed)
    h = Harness(cfg)
    h.admit(rng.randint(3, 6))
    h.write(0, h.reqs[0].addrs, torch.int64, seed, False)
    seen = set()
    for _ in range(24):
        seen.add(random_step(h, rng))
        h.check()
    assert {"prepare", "write"} <= seen
    h.release_all()


def _script(pool) -> list:
    """Admit two requests, write, prepare (evicting in the offload case); what it saw."""
    a = pool.admit(num_tokens=6)
    b = pool.admit(num_tokens=5)
    seen = [a.addresses.tolist(), b.addresses.tolist()]
    for layer in range(3):
        pool.write(layer, torch.cat([a.addresses, b.addresses]), random_rows(50 + layer, 11, 12))
    for group, sel in [
        (0, [[0, 1, 2, -1], [6, 7, 6, -1]]),
        (1, [[3, 4, 5, -1], [10, -1, 9, 8]]),
        (0, [[3, 4, 5, 3], [8, 9, 10, 8]]),  # evicts (quota 3) in the offload case
    ]:
        s0 = pool.stats()
        slots = pool.prepare(group, torch.tensor(sel)).slots
        s1 = pool.stats()
        seen.append((slots.tolist(), {k: s1[k] - s0[k] for k in STAT_COUNTERS}))
        used = slots[slots >= 0].long()  # the rows behind the slots (dummy rows hold padding junk)
        seen.append([pool.gpu_buffer(layer)[used] for layer in pool.group_layers(group)])
    return seen


@pytest.mark.parametrize(
    "cfg",
    [offload_config(cpu=17, quota=3, requests=2), replicated_config(world=3, gpu=17)],
    ids=["offload-quota-3-so-the-script-evicts", "replicated-world-3"],
)
def test_release_returns_everything(cfg: PoolConfig) -> None:
    h = Harness(cfg)
    rng = random.Random(5)
    for _ in range(3):
        h.admit(rng.randint(2, 5))
    for _ in range(8):
        random_step(h, rng)
    h.check()
    with looking_behind_reset() as resets:
        h.release_all()  # 0 live, 0 distinct, 0 physical, every address free
    assert resets, "the pool never reached the reset this test looks behind"
    used, fresh = h.pool, Pool(cfg)
    if not h.offload:
        residency = ("mapping", "owner", "ver", "q_slot", "q_ver", "gpu_free", "cpu_free", "gctl")
        u, f = used.state_dict(), fresh.state_dict()
        assert_same_state({k: f[k] for k in residency}, {k: u[k] for k in residency})
    # Same calls, same answers: addresses, slots, counter deltas, buffered bytes.
    got, want = _script(used), _script(fresh)
    assert_same_state(want, got)
    used.check_invariants()
