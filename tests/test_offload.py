"""The CPU-offload baseline's own rules (``CPUOffloadBaseline``; ``docs/design.md``, sections 4 and 5).

- One exact LRU a request: a hypothesis state machine drives the model of
  ``tests/baseline_harness.py``, and every prepare's hits, misses and victims (and the slots they
  imply) must match a plain per-request LRU of ``slots_per_request`` entries a group.
- Its counters by hand: GPU rows are copies of CPU rows, so distinct entries / physical slots is
  distinct / (distinct + buffered) < 1 once anything is buffered (invariant 1); ``bytes_in`` is a
  group's rows a miss, ``bytes_out`` every written row at once (the eager backup).
- Its limits (invariant 8): more distinct addresses of one request in one prepare than its quota,
  more requests than ``max_requests``, more tokens than CPU rows, each refused with nothing changed;
  the quota is per request, and a refused admission does not keep a request buffer.

Pools are tiny (quotas of 1..4, 12-byte rows, 3 layers in groups of 2 so the last group is short):
kernels run under the Triton interpreter on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction

import pytest
import torch
from baseline_harness import Harness, note
from helpers import expect_rejected, loaded_pool, offload_config, random_rows
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ulakv import CapacityError, InvalidInputError, Pool
from ulakv.testing import kernel_settings

# --------------------------------------------------------------------------------------------------
# one exact LRU a request (hypothesis)


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


OffloadMachine.TestCase.settings = kernel_settings(stateful_step_count=6)  # the kernel profile's 25
TestOffloadLRU = OffloadMachine.TestCase


# --------------------------------------------------------------------------------------------------
# the ratio and byte counters, by hand


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
# the limits: quota, requests, CPU rows


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
    s = loaded_pool("offload")
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
    expect_rejected(pool, InvalidInputError, lambda: pool.admit(num_tokens=-3), live)
    expect_rejected(pool, CapacityError, lambda: pool.extend(a, 5), live)
    b = pool.admit(num_tokens=4)  # the second buffer is still free
    assert b.addresses.tolist() == [5, 6, 7, 8]
    blocks = (pool.prepare(1, torch.tensor([[0, 1], [5, 6]])).slots // (2 + 1)).tolist()  # quota 2
    assert blocks[0][0] == blocks[0][1] != blocks[1][0] == blocks[1][1], "one buffer a request"
    pool.check_invariants()
