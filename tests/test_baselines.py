"""Tests of the two baseline layouts: ``Replicated(world)`` and ``CPUOffloadBaseline``.

Both are comparison points, so they must be as correct as ulakv's own layouts (``docs/design.md``, section 4):
nothing lost, every selected entry on the GPU holding its bytes, bad input refused with nothing
changed, release returning everything. On top of that each has numbers of its own to get exactly
right, because the comparisons quote them:

- ``Replicated``: distinct entries / physical slots is exactly ``1 / world`` (every replica counted).
- ``CPUOffloadBaseline``: each request an exact LRU of ``slots_per_request`` entries a group, so hits,
  misses and victims are those of a plain per-request LRU model; GPU rows are copies of CPU rows, so
  distinct / physical = distinct / (distinct + buffered) < 1 once anything is buffered, distinct
  being groups x live (a CPU row each) or the entries written or selected in their group (see
  ``Harness._check_offload``); ``bytes_in`` is a group's rows a miss, ``bytes_out`` the written
  rows (the eager backup).

One ``Harness`` drives a pool and a plain-Python model side by side and checks everything after
every call; a seeded random-traffic test and a hypothesis state machine drive it. The buffered
residency the ratio needs is inferred from the slots ``prepare`` returns (a slot handed to a miss
evicts whatever that slot held), independently of the LRU model, and the two must agree.

Pools are tiny and oddly sized (12-, 20- and 5-byte rows, 3 or 5 layers in groups of 2 so the last
group is short, quotas of 1..4): kernels run under the Triton interpreter on CPU.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import pytest
import torch
from helpers import assert_same_state, looking_behind_reset
from hypothesis import currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ulakv import (
    CapacityError,
    ConfigError,
    EntrySpec,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    PoolConfig,
    Sequence,
    UlakvError,
)
from ulakv.layouts import CPUOffloadBaseline, Replicated

# A layer or group index out of range, or a bad token count: either input-error class of ulakv.
INDEX_ERRORS = (InvalidInputError, InvalidAddressError)
STAT_COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "victims")


def offload_config(
    cpu: int = 17,
    quota: int = 3,
    requests: int = 2,
    bpl: int = 12,
    layers: int = 3,
    lpg: int = 2,
    device: str = "cpu",
) -> PoolConfig:
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=bpl),
        num_layers=layers,
        layers_per_group=lpg,
        layout=CPUOffloadBaseline(cpu_slots=cpu, slots_per_request=quota, max_requests=requests),
        device=device,
    )


def replicated_config(
    world: int = 3, gpu: int = 13, bpl: int = 12, layers: int = 3, lpg: int = 2, device: str = "cpu"
) -> PoolConfig:
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=bpl),
        num_layers=layers,
        layers_per_group=lpg,
        layout=Replicated(world=world, gpu_slots=gpu),
        device=device,
    )


def random_rows(seed: int, n: int, width: int, strided: bool = False) -> torch.Tensor:
    """Random bytes; ``strided`` gives a non-contiguous view (every other column of wider rows)."""
    gen = torch.Generator().manual_seed(seed)
    if strided:
        return torch.randint(0, 256, (n, 2 * width), dtype=torch.uint8, generator=gen)[:, ::2]
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)


def snapshot(pool, live: list[int]) -> dict:
    """Everything observable about a pool: counters, free addresses, every layer's GPU buffer, the
    bytes of the ``live`` addresses, and (a ``Pool``) ``state_dict()``. Equal snapshots (launch
    counters aside) mean a call changed nothing."""
    live = torch.tensor(sorted(live), dtype=torch.int64)
    snap = {
        "stats": pool.stats(),
        "free": pool.free_addresses,
        "buffers": [pool.gpu_buffer(layer).clone() for layer in range(pool.config.num_layers)],
        "reads": [pool.read(layer, live) for layer in range(pool.config.num_layers)] if len(live) else [],
    }
    if hasattr(pool, "state_dict"):
        snap["state"] = pool.state_dict()
    return snap


def note(what: str) -> None:
    """A hypothesis event when under hypothesis (the seeded traffic tests run without it)."""
    if currently_in_test_context():
        event(what)


def expect_rejected(pool, exc, call: Callable[[], object], live: list[int]) -> None:
    """Invariant 8: ``call`` raises ``exc`` and the pool is exactly as it was."""
    before = snapshot(pool, live)
    with pytest.raises(exc):
        call()
    assert_same_state(before, snapshot(pool, live))


# --------------------------------------------------------------------------------------------------
# the harness: a pool and its model, checked after every call


@dataclass(eq=False)
class Req:
    seq: Sequence
    addrs: list[int]
    # CPUOffloadBaseline: per group, the request's buffered addresses -> slot, least recent first.
    cache: list[OrderedDict[int, int]]
    block: int | None = None  # which request buffer its slots fall in (learned at its first prepare)


@dataclass
class Harness:
    """Drives ``pool`` and a model of it; every method checks what it can, ``check`` the rest."""

    cfg: PoolConfig
    pool: object = None
    reqs: list[Req] = field(default_factory=list)
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, addr) -> row
    owner: dict[int, Req] = field(default_factory=dict)  # live address -> its request
    homed: set[tuple[int, int]] = field(default_factory=set)  # (group, addr) written or selected there
    # CPUOffloadBaseline: per group, buffer slot -> address, inferred from slots prepare returned.
    occupied: list[dict[int, int]] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAT_COUNTERS, 0))

    def __post_init__(self) -> None:
        self.pool = Pool(self.cfg)
        lay = self.cfg.layout
        self.offload = isinstance(lay, CPUOffloadBaseline)
        self.L, self.W, self.groups = self.cfg.num_layers, self.cfg.entry.bytes_per_layer, self.cfg.num_groups
        self.cap = lay.capacity
        self.occupied = [{} for _ in range(self.groups)]
        assert self.pool.capacity == self.cap and self.pool.free_addresses == self.cap
        assert self.pool.num_groups == self.groups
        if self.offload:
            self.Q, self.R = lay.slots_per_request, lay.max_requests
            rows = self.R * (self.Q + 1) + 1  # each buffer with its dummy row, one final dummy
        else:
            rows = lay.gpu_slots + 1
        for layer in range(self.L):
            buf = self.pool.gpu_buffer(layer)
            assert buf.dtype == torch.uint8 and buf.shape == (rows, self.W)

    # -- helpers -------------------------------------------------------------------------------
    def layers(self, group: int) -> list[int]:
        return list(self.cfg.group_layers(group))

    def expected(self, layer: int, addrs: list[int]) -> torch.Tensor:
        out = torch.zeros(len(addrs), self.W, dtype=torch.uint8)
        for i, a in enumerate(addrs):
            row = self.rows.get((layer, a))
            if row is not None:
                out[i] = row
        return out

    def lowest_free(self, n: int) -> list[int]:
        return sorted(set(range(self.cap)) - set(self.owner))[:n]

    def live_reqs(self) -> list[Req]:
        return [r for r in self.reqs if r.addrs]

    # -- admission -----------------------------------------------------------------------------
    def admit(self, n: int) -> Req | None:
        full = self.offload and len(self.reqs) == self.R
        if n > self.pool.free_addresses or full:
            expect_rejected(self.pool, CapacityError, lambda: self.pool.admit(num_tokens=n), list(self.owner))
            return None
        want = self.lowest_free(n)
        seq = self.pool.admit(num_tokens=n)
        addrs = seq.addresses.tolist()
        assert seq.addresses.dtype == torch.int64 and len(seq) == n
        assert addrs == want, "admission takes the lowest free addresses"
        req = Req(seq, addrs, [OrderedDict() for _ in range(self.groups)])
        self.reqs.append(req)
        for a in addrs:
            self.owner[a] = req
        return req

    def extend(self, req: Req, n: int) -> None:
        if n > self.pool.free_addresses:
            expect_rejected(self.pool, CapacityError, lambda: self.pool.extend(req.seq, n), list(self.owner))
            return
        want = self.lowest_free(n)
        new = self.pool.extend(req.seq, n).tolist()
        assert new == want
        req.addrs += new
        assert req.seq.addresses.tolist() == req.addrs
        for a in new:
            self.owner[a] = req

    def release(self, req: Req) -> None:
        self.pool.release(req.seq)
        self.reqs.remove(req)
        gone = set(req.addrs)
        for a in gone:
            del self.owner[a]
        self.rows = {k: v for k, v in self.rows.items() if k[1] not in gone}
        self.homed = {k for k in self.homed if k[1] not in gone}
        for occ in self.occupied:
            for slot in [s for s, a in occ.items() if a in gone]:
                del occ[slot]

    # -- data path -----------------------------------------------------------------------------
    def write(self, layer: int, addrs: list[int], dtype: torch.dtype, seed: int, strided: bool) -> None:
        rows = random_rows(seed, len(addrs), self.W, strided)
        self.pool.write(layer, torch.tensor(addrs, dtype=dtype), rows)
        group = self.cfg.group_of(layer)
        for a, row in zip(addrs, rows, strict=True):
            if a >= 0:
                self.rows[(layer, a)] = row.clone()
                self.homed.add((group, a))
        if self.offload:  # the eager backup: every written row goes to the CPU at once
            self.totals["bytes_out"] += sum(a >= 0 for a in addrs) * self.W
            if layer == self.layers(group)[0]:
                self._offload_insert(group, [a for a in addrs if a >= 0])

    def _offload_insert(self, group: int, written: list[int]) -> None:
        """Written tokens enter their request's buffer: the last ``Q`` of each request's, one LRU
        round that counts only victims; their slots are read back with ``residency``."""
        mine: dict[Req, list[int]] = {}
        for a in written:
            mine.setdefault(self.owner[a], []).append(a)
        mine = {req: addrs[-self.Q :] for req, addrs in mine.items()}
        tails = [a for addrs in mine.values() for a in addrs]
        if not tails:
            return
        rows = self.pool.residency(group, torch.tensor(tails)).tolist()
        slot_of = dict(zip(tails, rows, strict=True))
        assert all(s >= 0 for s in rows), "a written token is not in its request's buffer"
        step = dict.fromkeys(STAT_COUNTERS, 0)
        self._offload_prepare(group, mine, slot_of, step)
        self.totals["victims"] += step["victims"]

    def prepare(self, group: int, entries: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        topk = torch.tensor(entries, dtype=dtype).view(shape)
        order = list(dict.fromkeys(a for a in entries if a >= 0))  # distinct, by first position
        mine: dict[Req, list[int]] = {}
        for a in order:
            mine.setdefault(self.owner[a], []).append(a)
        if self.offload and any(len(v) > self.Q for v in mine.values()):
            note("prepare: over a request's quota")
            expect_rejected(
                self.pool, CapacityError, lambda: self.pool.prepare(group, topk), list(self.owner)
            )
            return
        if not self.offload and order:
            before = self.pool.residency(group, torch.tensor(order)).tolist()
        s0 = self.pool.stats()

        sel = self.pool.prepare(group, topk)

        s1 = self.pool.stats()
        assert sel.group == group
        slots = sel.slots
        assert slots.dtype == torch.int32 and slots.shape == topk.shape
        slot_of: dict[int, int] = {}
        for a, s in zip(entries, slots.reshape(-1).tolist(), strict=True):
            if a < 0:
                assert s == -1, "padding must give slot -1"
            else:
                assert slot_of.setdefault(a, s) == s, f"address {a} got two slots"
        assert len(set(slot_of.values())) == len(slot_of), "two addresses share one slot"
        step = dict.fromkeys(STAT_COUNTERS, 0)
        if self.offload:
            self._offload_prepare(group, mine, slot_of, step)
        else:
            for a, r in zip(order, before if order else [], strict=True):
                assert 0 <= slot_of[a] < self.cfg.layout.gpu_slots
                if (group, a) in self.homed:
                    assert r == slot_of[a], "a hit keeps its slot"
                    step["hits"] += 1
                else:
                    step["misses"] += 1
                self.homed.add((group, a))
        # Invariant 3: every selected slot holds its address's bytes, in every layer of the group.
        if order:
            index = torch.tensor([slot_of[a] for a in order], dtype=torch.int64)
            for layer in self.layers(group):
                got = self.pool.gpu_buffer(layer)[index]
                assert torch.equal(got, self.expected(layer, order)), f"layer {layer}: slot bytes differ"
        for key in STAT_COUNTERS:
            assert s1[key] - s0[key] == step[key], f"{key}: {s1[key] - s0[key]} != model {step[key]}"
            self.totals[key] += step[key]
        note("prepare: evicted" if step["victims"] else "prepare: no victims")
        note("prepare: some hits" if step["hits"] else "prepare: no hits")

    def _offload_prepare(
        self, group: int, mine: dict[Req, list[int]], slot_of: dict[int, int], step: dict[str, int]
    ) -> None:
        """One exact LRU a request: hits, misses and victims of the model, checked against slots."""
        Q, occ = self.Q, self.occupied[group]
        for req, addrs in mine.items():
            cache = req.cache[group]
            blocks = {slot_of[a] // (Q + 1) for a in addrs}
            assert len(blocks) == 1, f"one request's slots fall in buffers {blocks}"
            block = blocks.pop()
            assert 0 <= block < self.R
            if req.block is None:
                assert block not in {r.block for r in self.reqs}, "two live requests share a GPU buffer"
                req.block = block
            assert block == req.block, "a request's buffer moved"
            assert all(slot_of[a] % (Q + 1) < Q for a in addrs), "a slot is a buffer's dummy row"
            hits = [a for a in addrs if a in cache]
            misses = [a for a in addrs if a not in cache]
            for a in hits:
                assert slot_of[a] == cache[a], "a hit keeps its slot"
            selected = set(addrs)
            evictable = [a for a in cache if a not in selected]  # least recent first
            victims = evictable[: max(0, len(misses) - (Q - len(cache)))]
            # Residency from slots alone: a miss's slot held a victim of this request, or nothing.
            taken = {occ[slot_of[a]] for a in misses if slot_of[a] in occ}
            assert taken == set(victims), f"evicted {sorted(taken)}, the LRU model {sorted(victims)}"
            for a in victims:
                del cache[a]
            for a in addrs:  # touched in first-position order: the last one is most recent
                cache.pop(a, None)
                cache[a] = slot_of[a]
                occ[slot_of[a]] = a
                self.homed.add((group, a))
            step["hits"] += len(hits)
            step["misses"] += len(misses)
            step["victims"] += len(victims)
            step["bytes_in"] += len(misses) * len(self.layers(group)) * self.W

    # -- whole-pool checks -----------------------------------------------------------------------
    def check(self) -> None:
        pool = self.pool
        pool.check_invariants()
        stats = pool.stats()
        live = len(self.owner)
        assert stats["live_addresses"] == live
        assert pool.free_addresses == self.cap - live
        for key in STAT_COUNTERS:
            assert stats[key] == self.totals[key], f"{key}: {stats[key]} != model {self.totals[key]}"
        if self.offload:
            self._check_offload(stats, live)
        else:
            self._check_replicated(stats)
        # Invariant 2: every live address reads back exactly the bytes last written (or zeros).
        if self.owner:
            addrs = sorted(self.owner)
            index = torch.tensor(addrs, dtype=torch.int64)
            for layer in range(self.L):
                got = pool.read(layer, index)
                assert got.dtype == torch.uint8 and got.shape == (len(addrs), self.W)
                assert torch.equal(got, self.expected(layer, addrs)), f"layer {layer}: read-back differs"

    def _check_offload(self, stats: dict[str, int], live: int) -> None:
        buffered = sum(len(occ) for occ in self.occupied)
        assert buffered == sum(len(c) for r in self.reqs for c in r.cache)
        for g, occ in enumerate(self.occupied):
            model = {s: a for r in self.reqs for a, s in r.cache[g].items()}
            assert occ == model, f"group {g}: residency from slots disagrees with the LRU model"
        # Distinct entries are those holding data in their group (written or selected there), as
        # ``Pool`` counts them; each one's CPU row is its home, buffered GPU rows are copies.
        expect = len(self.homed)
        assert stats["distinct_entries"] == stats["cpu_slots_used"] == expect
        assert stats["gpu_slots_used"] == buffered
        assert stats["physical_slots_used"] == expect + buffered
        if expect:
            ratio = Fraction(stats["distinct_entries"], stats["physical_slots_used"])
            assert ratio == Fraction(expect, expect + buffered)
            assert (ratio < 1) == (buffered > 0)
        # Buffered rows are copies, and a write refreshes them: every one equals the latest bytes.
        for g, occ in enumerate(self.occupied):
            if occ:
                slots = torch.tensor(list(occ), dtype=torch.int64)
                for layer in self.layers(g):
                    got = self.pool.gpu_buffer(layer)[slots]
                    want = self.expected(layer, list(occ.values()))
                    assert torch.equal(got, want), f"layer {layer}: a buffered copy is stale"

    def _check_replicated(self, stats: dict[str, int]) -> None:
        world = self.cfg.layout.world
        n = len(self.homed)
        assert stats["replicas"] == world
        assert stats["distinct_entries"] == stats["gpu_slots_used"] == n
        assert stats["cpu_slots_used"] == 0
        assert stats["physical_slots_used"] == world * n
        if n:
            assert Fraction(stats["distinct_entries"], stats["physical_slots_used"]) == Fraction(1, world)
        for g in range(self.groups):
            addrs = sorted(a for h, a in self.homed if h == g)
            if not addrs:
                continue
            res = self.pool.residency(g, torch.tensor(addrs)).tolist()
            assert all(0 <= s < self.cfg.layout.gpu_slots for s in res), "a homed entry is off the GPU"
            assert len(set(res)) == len(res)
            for layer in self.layers(g):
                got = self.pool.gpu_buffer(layer)[torch.tensor(res, dtype=torch.int64)]
                assert torch.equal(got, self.expected(layer, addrs)), f"layer {layer}: GPU bytes differ"

    def release_all(self) -> None:
        while self.reqs:
            self.release(self.reqs[-1])
        stats = self.pool.stats()
        assert stats["live_addresses"] == stats["distinct_entries"] == stats["physical_slots_used"] == 0
        assert stats["gpu_slots_used"] == stats["cpu_slots_used"] == 0
        assert self.pool.free_addresses == self.cap
        self.check()


# --------------------------------------------------------------------------------------------------
# 1. nothing lost, bit-exact, under random traffic (both baselines)


def random_step(h: Harness, rng: random.Random) -> str:
    """One random call: admit / extend / write / prepare / release (prepares most often)."""
    live = h.live_reqs()
    kinds = ["admit"] * 2 + ["release"] * (1 if h.reqs else 0)
    if h.reqs:
        kinds += ["extend"] * 2
    if live:
        kinds += ["write"] * 4 + ["prepare"] * 6
    kind = rng.choice(kinds)
    dtype = rng.choice([torch.int32, torch.int64])
    if kind == "admit":
        h.admit(rng.randint(0, 7))
    elif kind == "extend":
        h.extend(rng.choice(h.reqs), rng.randint(0, 3))
    elif kind == "release":
        h.release(rng.choice(h.reqs))
    elif kind == "write":
        candidates = [a for r in rng.sample(live, rng.randint(1, len(live))) for a in r.addrs]
        addrs = rng.sample(candidates, rng.randint(1, min(len(candidates), 6))) + [-1] * rng.randint(0, 2)
        rng.shuffle(addrs)
        h.write(rng.randrange(h.L), addrs, dtype, rng.randrange(2**31), rng.random() < 0.3)
    else:
        group = rng.randrange(h.groups)
        batch = [rng.choice(live) for _ in range(rng.randint(1, 3))]  # a request may fill two rows
        # Each request draws from a window of its addresses, usually within its quota.
        limit = (h.Q + (rng.random() < 0.15)) if h.offload else 6
        window = {r: rng.sample(r.addrs, min(len(r.addrs), rng.randint(1, limit))) for r in batch}
        q, k = rng.choice([0, 1, 2, 3]), rng.randint(1, 5)
        entries = [
            rng.choice(window[r]) if rng.random() < 0.8 else -1 for r in batch for _ in range(max(q, 1) * k)
        ]
        shape = (len(batch), q, k) if q else (len(batch), k)
        h.prepare(group, entries, shape, dtype)
    return kind


TRAFFIC_CASES = [
    ("offload-b12-l3g2-q3-r2-c17", offload_config(cpu=17, quota=3, requests=2, bpl=12, layers=3, lpg=2)),
    ("offload-b20-l5g2-q4-r3-c23", offload_config(cpu=23, quota=4, requests=3, bpl=20, layers=5, lpg=2)),
    ("offload-b5-l2g1-q2-r1-c9", offload_config(cpu=9, quota=2, requests=1, bpl=5, layers=2, lpg=1)),
    ("replicated-w3-b12-l3g2-g13", replicated_config(world=3, gpu=13, bpl=12, layers=3, lpg=2)),
    ("replicated-w8-b20-l5g2-g11", replicated_config(world=8, gpu=11, bpl=20, layers=5, lpg=2)),
    ("replicated-w1-b5-l2g1-g9", replicated_config(world=1, gpu=9, bpl=5, layers=2, lpg=1)),
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


# --------------------------------------------------------------------------------------------------
# 2. CPUOffloadBaseline against a per-request exact-LRU model (hypothesis)


class OffloadMachine(RuleBasedStateMachine):
    """Random traffic on a tiny CPU-offload pool; the harness's model is one exact LRU of
    ``slots_per_request`` entries per request per group, and every prepare's hits, misses and
    victims (and the slots they imply) must match it exactly."""

    h: Harness | None = None

    @initialize(
        cpu=st.integers(6, 16),
        quota=st.integers(1, 3),
        requests=st.integers(1, 3),
        layers=st.integers(1, 3),
        bpl=st.sampled_from([1, 5, 12, 20]),
        data=st.data(),
    )
    def build(self, cpu: int, quota: int, requests: int, layers: int, bpl: int, data: st.DataObject) -> None:
        lpg = data.draw(st.integers(1, layers), label="layers_per_group")
        self.h = Harness(offload_config(cpu, quota, requests, bpl, layers, lpg))
        for _ in range(data.draw(st.integers(1, requests), label="first requests")):
            self.h.admit(data.draw(st.integers(1, max(1, cpu // requests)), label="tokens"))
        everything = [a for r in self.h.reqs for a in r.addrs]
        self.h.write(0, everything, torch.int64, data.draw(st.integers(0, 2**31 - 1), label="seed"), False)
        self.h.check()
        self._prepare_once(data, reuse=False)  # start with something buffered

    # Three rules only: hypothesis switches rules off at random per example (swarm testing), and
    # with admit, extend and release as rules of their own most of 30 examples never prepared.
    @rule(data=st.data())
    def churn(self, data: st.DataObject) -> None:
        """Admit, extend or release (sometimes every request at once)."""
        h = self.h
        kind = data.draw(st.sampled_from(["admit", "extend", "release"] if h.reqs else ["admit"]))
        if kind == "admit":
            h.admit(data.draw(st.integers(0, 5), label="tokens"))
        elif kind == "extend":
            h.extend(data.draw(st.sampled_from(h.reqs), label="request"), data.draw(st.integers(0, 3)))
        elif data.draw(st.integers(0, 4), label="release all (0)") == 0:
            note("release: all")
            h.release_all()  # invariant 6: nothing live, nothing buffered, every address free
        else:
            h.release(data.draw(st.sampled_from(h.reqs), label="request"))

    @precondition(lambda self: self.h.live_reqs())
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        live = [a for r in self.h.live_reqs() for a in r.addrs]
        addrs = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1, max_size=5), label="addrs")
        addrs = data.draw(st.permutations(addrs + [-1] * data.draw(st.integers(0, 1))), label="order")
        layer = data.draw(st.integers(0, self.h.L - 1), label="layer")
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
        self.h.write(layer, addrs, dtype, data.draw(st.integers(0, 2**31 - 1)), data.draw(st.booleans()))

    @precondition(lambda self: self.h.live_reqs())
    @rule(data=st.data())
    def prepare(self, data: st.DataObject) -> None:
        # A few rounds a rule: hypothesis runs are short, and LRU order needs consecutive rounds.
        for _ in range(data.draw(st.integers(1, 2), label="rounds")):
            self._prepare_once(data, reuse=data.draw(st.booleans(), label="reuse buffered"))

    def _prepare_once(self, data: st.DataObject, reuse: bool) -> None:
        h = self.h
        group = data.draw(st.integers(0, h.groups - 1), label="group")
        batch = data.draw(st.lists(st.sampled_from(h.live_reqs()), min_size=1, max_size=2), label="rows")
        window = {}
        for r in dict.fromkeys(batch):
            # Each request draws from a window of its addresses, at most one over its quota.
            # ``reuse`` takes all but one or two of it from what its buffer holds: hits, and
            # misses in a full buffer whose victims LRU order decides.
            cached = list(r.cache[group])
            fresh = [a for a in r.addrs if a not in cached]
            if reuse and cached and fresh:
                old = data.draw(st.lists(st.sampled_from(cached), unique=True, max_size=h.Q - 1))
                new = data.draw(st.lists(st.sampled_from(fresh), unique=True, min_size=1, max_size=2))
            else:
                old = []
                new = data.draw(st.lists(st.sampled_from(r.addrs), unique=True, min_size=1, max_size=h.Q + 1))
            window[r] = (old + new)[: h.Q + 1]
        q = data.draw(st.sampled_from([0, 1, 2]), label="query positions (0: [B, K])")
        k = data.draw(st.integers(1, 4), label="k")
        entries = []
        for r in batch:
            pick = st.one_of(st.just(-1), st.sampled_from(window[r]))
            entries += data.draw(st.lists(pick, min_size=max(q, 1) * k, max_size=max(q, 1) * k))
        shape = (len(batch), q, k) if q else (len(batch), k)
        dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="dtype")
        h.prepare(group, entries, shape, dtype)

    @invariant()
    def agrees_with_model(self) -> None:
        if self.h is not None:
            self.h.check()


OffloadMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=6, deadline=None)
TestOffloadLRU = OffloadMachine.TestCase


# --------------------------------------------------------------------------------------------------
# 3. stats: the ratios and byte counters, by hand


@pytest.mark.parametrize("world", [1, 3, 8], ids=["world1", "world3", "world8"])
def test_replicated_ratio_is_one_over_world(world: int) -> None:
    pool = Pool(replicated_config(world=world, gpu=13, bpl=20, layers=5, lpg=2))
    assert pool.capacity == 13, "capacity is one replica's slots, not world times that"
    a = pool.admit(num_tokens=7)
    b = pool.admit(num_tokens=6)
    with pytest.raises(CapacityError):
        pool.admit(num_tokens=1)
    for layer in range(5):  # a in every layer, b in the first group only
        pool.write(layer, a.addresses, random_rows(layer, 7, 20))
    pool.write(1, b.addresses[:4], random_rows(9, 4, 20))
    stats = pool.stats()
    homed = 3 * 7 + 4  # three groups of a, group 0 of four of b's
    assert stats["replicas"] == world
    assert stats["distinct_entries"] == stats["gpu_slots_used"] == homed
    assert stats["physical_slots_used"] == world * homed
    assert Fraction(stats["distinct_entries"], stats["physical_slots_used"]) == Fraction(1, world)
    assert stats["bytes_in"] == stats["bytes_out"] == 0, "a GPU-only replica moves nothing"
    sel = pool.prepare(
        2, torch.tensor([[*a.addresses[:3].tolist(), -1], [*b.addresses[:2].tolist(), -1, -1]])
    )
    stats = pool.stats()
    assert stats["hits"] == 3 and stats["misses"] == 2  # b had no home in group 2
    assert Fraction(stats["distinct_entries"], stats["physical_slots_used"]) == Fraction(1, world)
    assert torch.equal(pool.gpu_buffer(4)[sel.slots[0, :3].long()], random_rows(4, 7, 20)[:3])
    pool.release(a)
    pool.release(b)
    stats = pool.stats()
    assert stats["distinct_entries"] == stats["physical_slots_used"] == 0


def test_offload_ratio_and_bytes_by_hand() -> None:
    """Quota 4, groups {0, 1} and {2}, 12-byte rows; every number worked out by hand."""
    W = 12
    pool = Pool(offload_config(cpu=20, quota=4, requests=2, bpl=W, layers=3, lpg=2))
    a = pool.admit(num_tokens=6)  # addresses 0..5
    b = pool.admit(num_tokens=5)  # 6..10
    A, B = a.addresses.tolist(), b.addresses.tolist()
    rows = {layer: random_rows(40 + layer, 11, W) for layer in range(3)}
    for layer in range(3):
        pool.write(layer, torch.tensor(A + B), rows[layer])
    live, groups = 11, 2  # everything written in every layer: every CPU row holds data

    def check(buffered: int, hits: int, misses: int, bytes_in: int, victims: int) -> None:
        s = pool.stats()
        assert s["distinct_entries"] == groups * live
        assert s["physical_slots_used"] == groups * live + buffered
        assert s["gpu_slots_used"] == buffered
        assert Fraction(s["distinct_entries"], s["physical_slots_used"]) == Fraction(22, 22 + buffered)
        assert (s["hits"], s["misses"], s["bytes_in"], s["victims"]) == (hits, misses, bytes_in, victims)
        assert s["bytes_out"] == 3 * 11 * W  # the eager backup: every written row once

    # The writes put each request's last 4 tokens in its buffer, in both groups (a write counts
    # no hit, miss or byte in): a holds A2 A3 A4 A5, b holds B1 B2 B3 B4 (least recent first).
    # bytes_in: a miss in group 0 brings 2 layers' rows, in group 1 one layer's.
    check(buffered=16, hits=0, misses=0, bytes_in=0, victims=0)
    pool.prepare(0, torch.tensor([[A[0], A[1], A[2], A[1]]]))  # A2 hits; A0 A1 miss, A3 A4 go
    check(buffered=16, hits=1, misses=2, bytes_in=2 * 2 * W, victims=2)  # a, group 0: A5 A0 A1 A2
    # Group 1: duplicates across query positions count once. a: A0 A1 miss, A2 A3 go;
    # b: B0 misses, B1 hits, B2 goes.
    sel = pool.prepare(1, torch.tensor([[[A[0], A[1]], [-1, A[0]]], [[B[0], B[0]], [B[1], -1]]]))
    check(buffered=16, hits=2, misses=5, bytes_in=2 * 2 * W + 3 * W, victims=5)
    assert torch.equal(pool.gpu_buffer(2)[sel.slots[1, 1, 0].long()], rows[2][6 + 1])
    pool.prepare(0, torch.tensor([[A[3], A[2], A[4], A[5]]]))  # A2 A5 hit; A3 A4 miss; A0 A1 go
    check(buffered=16, hits=4, misses=7, bytes_in=4 * 2 * W + 3 * W, victims=7)  # A3 A2 A4 A5
    pool.prepare(0, torch.tensor([[A[0], A[5], -1, -1]]))  # A0 misses, A5 hits, A3 goes: A2 A4 A0 A5
    check(buffered=16, hits=5, misses=8, bytes_in=5 * 2 * W + 3 * W, victims=8)
    sel = pool.prepare(0, torch.tensor([[A[3], A[2], -1, -1]]))  # A3 misses, A2 hits, A4 goes
    check(buffered=16, hits=6, misses=9, bytes_in=6 * 2 * W + 3 * W, victims=9)
    # A write goes to the CPU at once (bytes_out) and refreshes the buffered copy in place.
    new = random_rows(99, 2, W)
    pool.write(0, torch.tensor([A[2], -1]), new)
    assert torch.equal(pool.gpu_buffer(0)[sel.slots[0, 1].long()], new[0])
    assert torch.equal(pool.read(0, torch.tensor([A[2]])), new[:1])
    s = pool.stats()
    assert s["bytes_out"] == 3 * 11 * W + W and s["bytes_in"] == 6 * 2 * W + 3 * W and s["victims"] == 9
    assert pool.prepare(0, torch.tensor([[A[2]]])).slots[0, 0] == sel.slots[0, 1]
    assert pool.stats()["hits"] == 7
    pool.release(a)  # a's CPU rows and both its buffers go; b's stay (4 entries a group)
    s = pool.stats()
    assert s["distinct_entries"] == groups * 5 and s["physical_slots_used"] == groups * 5 + 8
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# 4. bad input raises the documented error and changes nothing


@dataclass
class Loaded:
    pool: object
    seq: Sequence
    gone: Sequence
    live: torch.Tensor  # 9 live addresses, written in every layer, some buffered
    dead: torch.Tensor  # 3 released addresses


def _build_loaded(kind: str) -> Loaded:
    if kind == "offload":
        pool = Pool(offload_config(cpu=17, quota=3, requests=2, bpl=12, layers=3, lpg=2))
    else:
        pool = Pool(replicated_config(world=3, gpu=17, bpl=12, layers=3, lpg=2))
    seq = pool.admit(num_tokens=9)
    gone = pool.admit(num_tokens=3)
    everything = torch.cat([seq.addresses, gone.addresses])
    for layer in range(3):
        pool.write(layer, everything, random_rows(layer, 12, 12))
    pool.prepare(0, seq.addresses[:3].view(1, 3))
    pool.prepare(1, torch.stack([seq.addresses[3:5], gone.addresses[:2]]))
    live, dead = seq.addresses.clone(), gone.addresses.clone()
    pool.release(gone)
    return Loaded(pool, seq, gone, live, dead)


_LOADED: dict[str, Loaded] = {}


def _loaded(kind: str) -> Loaded:
    """A deep copy of one loaded pool per kind (building it runs ~16 interpreted kernels; the
    bad-input table below would build it 80 times). ``Pool.__new__`` needs a config, so the pool
    is copied by hand; its sequences, copied in the same memo, point at the copy's id."""
    if kind not in _LOADED:
        _LOADED[kind] = _build_loaded(kind)
    base = _LOADED[kind]
    pool = object.__new__(type(base.pool))
    memo = {id(base.pool): pool}
    pool.__dict__.update(copy.deepcopy(base.pool.__dict__, memo))
    return copy.deepcopy(base, memo)


def _pair(x, y, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([[int(x), int(y)]], dtype=dtype)


def _rows(n: int, width: int = 12) -> torch.Tensor:
    return random_rows(7, n, width)


BAD_CALLS: list[tuple[str, Callable[[Loaded], object], type | tuple]] = [
    ("prepare-released", lambda s: s.pool.prepare(0, _pair(s.live[0], s.dead[0])), InvalidAddressError),
    (
        "prepare-released-int32",
        lambda s: s.pool.prepare(1, _pair(s.dead[1], s.live[1], torch.int32)),
        InvalidAddressError,
    ),
    ("prepare-addr-eq-capacity", lambda s: s.pool.prepare(0, _pair(s.live[0], 17)), InvalidAddressError),
    ("prepare-never-admitted", lambda s: s.pool.prepare(0, _pair(s.live[0], 14)), InvalidAddressError),
    ("prepare-addr-minus-2", lambda s: s.pool.prepare(0, _pair(s.live[0], -2)), InvalidAddressError),
    ("prepare-float", lambda s: s.pool.prepare(0, s.live[:3].float().view(1, 3)), InvalidInputError),
    ("prepare-int16", lambda s: s.pool.prepare(0, s.live[:3].short().view(1, 3)), InvalidInputError),
    ("prepare-1d", lambda s: s.pool.prepare(0, s.live[:3]), InvalidInputError),
    ("prepare-4d", lambda s: s.pool.prepare(0, s.live[:4].view(1, 1, 2, 2)), InvalidInputError),
    ("prepare-list", lambda s: s.pool.prepare(0, [[0, 1]]), InvalidInputError),
    (
        "prepare-meta-device",
        lambda s: s.pool.prepare(0, torch.zeros(1, 2, dtype=torch.int64, device="meta")),
        InvalidInputError,
    ),
    ("prepare-group-too-big", lambda s: s.pool.prepare(2, s.live[:2].view(1, 2)), INDEX_ERRORS),
    ("prepare-group-negative", lambda s: s.pool.prepare(-1, s.live[:2].view(1, 2)), INDEX_ERRORS),
    ("write-float-rows", lambda s: s.pool.write(0, s.live[:2], torch.zeros(2, 12)), InvalidInputError),
    ("write-int8-rows", lambda s: s.pool.write(2, s.live[:2], _rows(2).to(torch.int8)), InvalidInputError),
    ("write-rows-too-wide", lambda s: s.pool.write(0, s.live[:2], _rows(2, 13)), InvalidInputError),
    ("write-rows-count", lambda s: s.pool.write(1, s.live[:2], _rows(3)), InvalidInputError),
    ("write-rows-1d", lambda s: s.pool.write(0, s.live[:1], _rows(1)[0]), InvalidInputError),
    (
        "write-rows-meta-device",
        lambda s: s.pool.write(0, s.live[:2], torch.empty(2, 12, dtype=torch.uint8, device="meta")),
        InvalidInputError,
    ),
    (
        "write-addrs-meta-device",
        lambda s: s.pool.write(0, torch.zeros(2, dtype=torch.int64, device="meta"), _rows(2)),
        InvalidInputError,
    ),
    ("write-addrs-float", lambda s: s.pool.write(0, s.live[:2].float(), _rows(2)), InvalidInputError),
    ("write-addrs-2d", lambda s: s.pool.write(0, s.live[:2].view(1, 2), _rows(2)), InvalidInputError),
    ("write-duplicates", lambda s: s.pool.write(0, s.live[[0, 1, 0]], _rows(3)), InvalidAddressError),
    (
        "write-duplicates-int32-padded",
        lambda s: s.pool.write(
            2, torch.tensor([-1, int(s.live[4]), -1, int(s.live[4])], dtype=torch.int32), _rows(4)
        ),
        InvalidAddressError,
    ),
    (
        "write-released",
        lambda s: s.pool.write(1, torch.stack([s.live[0], s.dead[0]]), _rows(2)),
        InvalidAddressError,
    ),
    (
        "write-addr-eq-capacity",
        lambda s: s.pool.write(0, torch.tensor([int(s.live[0]), 17]), _rows(2)),
        InvalidAddressError,
    ),
    (
        "write-addr-minus-2",
        lambda s: s.pool.write(2, torch.tensor([-2, int(s.live[1])]), _rows(2)),
        InvalidAddressError,
    ),
    ("write-layer-too-big", lambda s: s.pool.write(3, s.live[:2], _rows(2)), INDEX_ERRORS),
    ("read-released", lambda s: s.pool.read(0, s.dead[:1]), InvalidAddressError),
    ("read-padding", lambda s: s.pool.read(1, torch.tensor([int(s.live[0]), -1])), InvalidAddressError),
    ("read-addr-eq-capacity", lambda s: s.pool.read(2, torch.tensor([17])), InvalidAddressError),
    ("read-float", lambda s: s.pool.read(0, s.live[:2].float()), InvalidInputError),
    ("read-layer-too-big", lambda s: s.pool.read(3, s.live[:1]), INDEX_ERRORS),
    ("gpu-buffer-layer-too-big", lambda s: s.pool.gpu_buffer(3), INDEX_ERRORS),
    ("release-twice", lambda s: s.pool.release(s.gone), InvalidAddressError),
    ("extend-released", lambda s: s.pool.extend(s.gone, 1), INDEX_ERRORS),
    ("admit-over-capacity", lambda s: s.pool.admit(num_tokens=s.pool.free_addresses + 1), CapacityError),
    ("extend-over-capacity", lambda s: s.pool.extend(s.seq, s.pool.free_addresses + 1), CapacityError),
    ("admit-negative", lambda s: s.pool.admit(num_tokens=-1), INDEX_ERRORS),
    ("admit-float", lambda s: s.pool.admit(num_tokens=2.0), INDEX_ERRORS),
]


@pytest.mark.parametrize("kind", ["offload", "replicated"])
@pytest.mark.parametrize(("call", "exc"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(kind: str, call: Callable[[Loaded], object], exc) -> None:
    s = _loaded(kind)
    expect_rejected(s.pool, exc, lambda: call(s), s.live.tolist())
    # Still usable: a request can still be admitted and everything still checks out.
    s.pool.admit(num_tokens=1)
    s.pool.check_invariants()


OFFLOAD_QUOTA_CASES = [
    ("one-row", lambda L: torch.tensor([L[:4]])),
    ("one-row-with-duplicates-and-padding", lambda L: torch.tensor([[L[0], L[1], L[0], -1, L[2], L[3]]])),
    ("across-rows-of-one-request", lambda L: torch.tensor([L[:3], L[1:4]])),
    ("bqk", lambda L: torch.tensor([[L[:2], L[2:4]]])),
    ("int32", lambda L: torch.tensor([L[4:8]], dtype=torch.int32)),
]


@pytest.mark.parametrize(
    "build", [c[1] for c in OFFLOAD_QUOTA_CASES], ids=[c[0] for c in OFFLOAD_QUOTA_CASES]
)
def test_offload_quota_exceeded_changes_nothing(build: Callable) -> None:
    """Quota 3: four distinct addresses of one request in one prepare is refused, however they
    are spread over rows; duplicates and padding do not count."""
    s = _loaded("offload")
    L = s.live.tolist()
    expect_rejected(s.pool, CapacityError, lambda: s.pool.prepare(0, build(L)), L)
    # Three distinct, duplicated across rows and query positions, fit; and so does another
    # request's three beside them (the quota is per request).
    M = s.pool.admit(num_tokens=3).addresses.tolist()
    ok = torch.tensor([[[L[5], L[6]], [L[7], L[5]]], [[M[0], -1], [M[1], M[2]]]])
    s0 = s.pool.stats()
    s.pool.prepare(0, ok)
    s1 = s.pool.stats()
    assert s1["misses"] - s0["misses"] == 6 and s1["hits"] == s0["hits"]


def test_offload_too_many_requests_changes_nothing() -> None:
    pool = Pool(offload_config(cpu=17, quota=3, requests=2))
    a = pool.admit(num_tokens=4)
    b = pool.admit(num_tokens=0)  # a request with no tokens still holds a GPU buffer
    pool.write(0, a.addresses, random_rows(1, 4, 12))
    pool.prepare(0, a.addresses[:3].view(1, 3))
    for n in (0, 1, 13):
        expect_rejected(pool, CapacityError, lambda n=n: pool.admit(num_tokens=n), [0, 1, 2, 3])
    pool.release(b)
    c = pool.admit(num_tokens=13)  # exactly what is left
    assert c.addresses.tolist() == list(range(4, 17))
    expect_rejected(pool, CapacityError, lambda: pool.admit(num_tokens=0), list(range(17)))
    pool.check_invariants()


def test_offload_admission_beyond_cpu_slots_keeps_the_buffer() -> None:
    """A refused admission (too many tokens) must not hold on to a request buffer."""
    pool = Pool(offload_config(cpu=9, quota=2, requests=2))
    a = pool.admit(num_tokens=5)
    live = a.addresses.tolist()
    expect_rejected(pool, CapacityError, lambda: pool.admit(num_tokens=5), live)
    expect_rejected(pool, InvalidAddressError, lambda: pool.admit(num_tokens=-3), live)
    expect_rejected(pool, CapacityError, lambda: pool.extend(a, 5), live)
    b = pool.admit(num_tokens=4)  # the second buffer is still free
    assert b.addresses.tolist() == [5, 6, 7, 8]
    blocks = (pool.prepare(1, torch.tensor([[0, 1], [5, 6]])).slots // (2 + 1)).tolist()  # quota 2
    assert blocks[0][0] == blocks[0][1] != blocks[1][0] == blocks[1][1], "one buffer a request"
    pool.check_invariants()


CONFIG_CASES: list[tuple[str, Callable[[], object]]] = [
    ("offload-cpu-0", lambda: CPUOffloadBaseline(cpu_slots=0)),
    ("offload-cpu-negative", lambda: CPUOffloadBaseline(cpu_slots=-5)),
    ("offload-cpu-float", lambda: CPUOffloadBaseline(cpu_slots=17.0)),
    ("offload-cpu-str", lambda: CPUOffloadBaseline(cpu_slots="17")),
    ("offload-cpu-bool", lambda: CPUOffloadBaseline(cpu_slots=True)),
    ("offload-cpu-too-many", lambda: CPUOffloadBaseline(cpu_slots=2**31)),
    ("offload-quota-0", lambda: CPUOffloadBaseline(cpu_slots=17, slots_per_request=0)),
    ("offload-quota-float", lambda: CPUOffloadBaseline(cpu_slots=17, slots_per_request=3.5)),
    ("offload-quota-none", lambda: CPUOffloadBaseline(cpu_slots=17, slots_per_request=None)),
    ("offload-requests-0", lambda: CPUOffloadBaseline(cpu_slots=17, max_requests=0)),
    ("offload-requests-negative", lambda: CPUOffloadBaseline(cpu_slots=17, max_requests=-1)),
    ("offload-requests-float", lambda: CPUOffloadBaseline(cpu_slots=17, max_requests=2.0)),
    (
        "offload-requests-x-quota-too-big",
        lambda: CPUOffloadBaseline(17, slots_per_request=2**20, max_requests=2**12),
    ),
    ("replicated-world-0", lambda: Replicated(world=0, gpu_slots=13)),
    ("replicated-world-negative", lambda: Replicated(world=-3, gpu_slots=13)),
    ("replicated-world-float", lambda: Replicated(world=3.0, gpu_slots=13)),
    ("replicated-world-bool", lambda: Replicated(world=True, gpu_slots=13)),
    ("replicated-gpu-0", lambda: Replicated(world=3, gpu_slots=0)),
    ("replicated-gpu-str", lambda: Replicated(world=3, gpu_slots="13")),
    ("replicated-gpu-too-many", lambda: Replicated(world=3, gpu_slots=2**31)),
]


@pytest.mark.parametrize("build", [c[1] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_baseline_config_raises_config_error(build: Callable[[], object]) -> None:
    # The bases the cases change are themselves valid: each case fails for its change.
    CPUOffloadBaseline(cpu_slots=17, slots_per_request=3, max_requests=2)
    Replicated(world=3, gpu_slots=13)
    with pytest.raises(ConfigError):
        build()


@pytest.mark.parametrize("kind", ["offload", "replicated"])
def test_empty_and_all_padding_selections_move_nothing(kind: str) -> None:
    s = _loaded(kind)
    L = s.live.tolist()
    before = s.pool.stats()
    for group, topk in [
        (0, torch.empty(2, 0, dtype=torch.int64)),
        (1, torch.empty(0, 3, 2, dtype=torch.int32)),
        (0, torch.full((2, 3), -1, dtype=torch.int64)),
        (1, torch.full((1, 2, 2), -1, dtype=torch.int32)),
    ]:
        slots = s.pool.prepare(group, topk).slots
        assert slots.dtype == torch.int32 and slots.shape == topk.shape
        assert bool((slots == -1).all())
    after = s.pool.stats()
    assert {k: v for k, v in after.items() if k != "launches"} == {
        k: v for k, v in before.items() if k != "launches"
    }
    # The buffered entries are still there: selecting them again hits.
    s.pool.prepare(0, torch.tensor([L[:3]]))
    assert s.pool.stats()["hits"] == before["hits"] + 3


@pytest.mark.parametrize("what", ["write", "read", "prepare"])
@pytest.mark.parametrize("kind", ["offload", "replicated"])
def test_strided_index_tensors(kind: str, what: str) -> None:
    """Index tensors that are views with a stride (``addrs[::3]``, ``topk[:, ::3]``, whose
    ``reshape(-1)`` is itself a strided view) mean the addresses they show."""
    s = _loaded(kind)
    L = s.live
    every_third = L[::3]  # [L0, L3, L6], stride 3
    written = random_rows(2, 12, 12)[[0, 3, 6]]  # what _loaded wrote there in layer 2
    if what == "write":
        rows = random_rows(61, 3, 12)
        s.pool.write(2, every_third, rows)
        assert torch.equal(s.pool.read(2, every_third.contiguous()), rows)
        assert torch.equal(s.pool.read(2, L[[1, 2, 4]]), random_rows(2, 12, 12)[[1, 2, 4]]), "others changed"
    elif what == "read":
        assert torch.equal(s.pool.read(2, every_third), written)
    else:
        topk = torch.stack([L, L])[:, ::3]  # [[L0, L3, L6], [L0, L3, L6]]
        slots = s.pool.prepare(1, topk).slots
        assert torch.equal(slots, s.pool.prepare(1, topk.contiguous()).slots)
        assert torch.equal(s.pool.gpu_buffer(2)[slots[1].long()], written)


# --------------------------------------------------------------------------------------------------
# 5. release returns everything: a pool whose requests all left behaves as a fresh pool


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
    ids=["offload-q3-r2-c17", "replicated-w3-g17"],
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


# --------------------------------------------------------------------------------------------------
# 6. the meta device: capacity planning only


@pytest.mark.parametrize(
    "cfg",
    [
        offload_config(cpu=2**20, quota=2048, requests=8, bpl=656, layers=78, lpg=4, device="meta"),
        replicated_config(world=8, gpu=2**20, bpl=656, layers=78, lpg=4, device="meta"),
    ],
    ids=["offload-glm5-shaped", "replicated-w8-glm5-shaped"],
)
def test_meta_device_admits_but_holds_no_data(cfg: PoolConfig) -> None:
    pool = Pool(cfg)
    assert pool.capacity == 2**20 and pool.num_groups == 20  # 78 = 19 x 4 + 2
    seqs = [pool.admit(num_tokens=2**17) for _ in range(8)]  # eight 128K-token requests fill it
    assert pool.free_addresses == 0
    assert [s.addresses.device.type for s in seqs] == ["meta"] * 8
    with pytest.raises(CapacityError):
        pool.admit(num_tokens=1)
    with pytest.raises(CapacityError):
        pool.extend(seqs[0], 1)
    assert pool.gpu_buffer(77).device.type == "meta"
    addrs = torch.zeros(2, dtype=torch.int64, device="meta")
    rows = torch.empty(2, 656, dtype=torch.uint8, device="meta")
    for call in (
        lambda: pool.write(0, addrs, rows),
        lambda: pool.prepare(0, addrs.view(1, 2)),
        lambda: pool.read(0, addrs),
    ):
        with pytest.raises(UlakvError, match="meta"):
            call()
    assert pool.free_addresses == 0


@pytest.mark.parametrize(
    "cfg",
    [offload_config(cpu=64, quota=8, requests=2, device="meta"), replicated_config(gpu=64, device="meta")],
    ids=["offload", "replicated"],
)
def test_meta_device_release(cfg: PoolConfig) -> None:
    pool = Pool(cfg)
    seq = pool.admit(num_tokens=40)
    pool.release(seq)
    assert pool.free_addresses == 64
    pool.admit(num_tokens=64)
