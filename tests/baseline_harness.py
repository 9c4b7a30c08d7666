"""The two baselines driven side by side with a plain-Python model of them (not a test file).

``Harness`` drives a ``Replicated`` or ``CPUOffloadBaseline`` pool and a model and checks everything
after every call (``docs/design.md``, section 4): what each live address reads back (invariant 2),
what each selected slot holds (3), the counters, the ratio distinct entries / physical slots (1),
admission taking the lowest free addresses, and refused calls changing nothing (8).

- ``Replicated``: distinct / physical is exactly ``1 / world`` (every replica counted).
- ``CPUOffloadBaseline``: each request an exact LRU of ``slots_per_request`` entries a group, so hits,
  misses and victims are those of a plain per-request LRU model; GPU rows are copies of CPU rows, so
  distinct / physical = distinct / (distinct + buffered) < 1 once anything is buffered, distinct
  being the entries written or selected in their group (see ``Harness._check_offload``);
  ``bytes_in`` is a group's rows a miss, ``bytes_out`` the written rows (the eager backup). The
  buffered residency the ratio needs is inferred from the slots ``prepare`` returns (a slot handed
  to a miss evicts whatever that slot held), independently of the LRU model, and the two must agree.

``random_step`` makes one random call on a harness; ``tests/test_baseline_traffic.py`` and the
hypothesis machine of ``tests/test_offload.py`` drive it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from helpers import STAT_COUNTERS, expect_rejected, random_rows
from hypothesis import currently_in_test_context, event

from ulakv import CapacityError, Pool, PoolConfig, Sequence
from ulakv.layouts import CPUOffloadBaseline


def note(what: str) -> None:
    """A hypothesis event when under hypothesis (the seeded traffic tests run without it)."""
    if currently_in_test_context():
        event(what)


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
    # -- data path -----------------------------------------------------------------------------
    def write(self, layer: int, addrs: list[int], dtype: torch.dtype, seed: int, strided: bool) -> None:
        rows = random_rows(seed, len(addrs), self.W, strided=strided)
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
# one random call


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
