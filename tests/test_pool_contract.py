"""Contract tests for ``ulakv.Pool`` (``docs/design.md``, sections 4 and 5: invariants, contract).

Every pool here is small and oddly sized on purpose: 7 or 13 GPU slots, rows of 656, 12 or 5 bytes,
three layers in groups of two so that the last group is short. On CPU the kernels run under the
Triton interpreter (about 10 ms a program), so pools stay at <= 64 GPU slots and selections at
<= 64 entries. Payloads are random bytes and every comparison is bit-exact (``torch.equal`` on
uint8), never with a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from helpers import assert_same_state, pool_config, small_pool
from nosync import HostSyncError, no_host_sync, skip_under_debug

import ulakv
from ulakv import (
    CapacityError,
    ConfigError,
    EntrySpec,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    Tiered,
)

# The API names no class for a layer or group index out of range, nor for a bad token count; these
# are input errors, so either input-error class of ulakv is accepted (never a bare IndexError).
INDEX_ERRORS = (InvalidInputError, InvalidAddressError)


# --------------------------------------------------------------------------------------------------
# helpers


def make_pool(
    *,
    gpu: int = 7,
    cpu: int = 13,
    bpl: int = 12,
    layers: int = 3,
    lpg: int = 2,
    validate: bool | None = None,
) -> Pool:
    return small_pool(gpu, cpu, bpl, layers, lpg, validate=validate)


def rand_rows(n: int, bpl: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, bpl), dtype=torch.uint8, generator=gen)


def addr_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@dataclass
class Model:
    """What the pool must hold: {(layer, address): row}; unwritten rows read as zeros."""

    bpl: int
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def write(self, pool: Pool, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        pool.write(layer, addrs, rows)
        for a, row in zip(addrs.tolist(), rows, strict=True):
            if a >= 0:
                self.rows[(layer, a)] = row.clone()

    def expected(self, layer: int, addrs: list[int]) -> torch.Tensor:
        out = torch.zeros(len(addrs), self.bpl, dtype=torch.uint8)
        for i, a in enumerate(addrs):
            if (layer, a) in self.rows:
                out[i] = self.rows[(layer, a)]
        return out

    def forget(self, addrs: list[int]) -> None:
        dead = set(addrs)
        self.rows = {k: v for k, v in self.rows.items() if k[1] not in dead}


def assert_reads(pool: Pool, model: Model, addrs: list[int]) -> None:
    if not addrs:
        return
    for layer in range(pool.config.num_layers):
        got = pool.read(layer, addr_tensor(addrs))
        assert got.dtype == torch.uint8
        assert got.shape == (len(addrs), model.bpl)
        assert torch.equal(got, model.expected(layer, addrs)), f"layer {layer} read-back differs"


def assert_selection_holds(
    pool: Pool, model: Model, group: int, topk: torch.Tensor, slots: torch.Tensor
) -> None:
    """Invariant 3: every selected address is GPU-resident and its slot holds its bytes."""
    assert slots.dtype == torch.int32
    assert slots.shape == topk.shape
    pad = topk == -1
    assert torch.equal(slots[pad], torch.full_like(slots[pad], -1)), "padding must give -1"
    addrs = topk[~pad].tolist()
    got_slots = slots[~pad].tolist()
    assert all(0 <= s < pool.config.layout.gpu_slots for s in got_slots), got_slots
    first: dict[int, int] = {}
    for a, s in zip(addrs, got_slots, strict=True):
        assert first.setdefault(a, s) == s, f"address {a} got two slots"
    assert len(set(first.values())) == len(first), "two addresses share one slot"
    if not first:
        return
    uniq = list(first)
    res = pool.residency(group, addr_tensor(uniq))
    assert res.tolist() == [first[a] for a in uniq], "residency disagrees with slots"
    index = torch.tensor([first[a] for a in uniq], dtype=torch.int64)
    for layer in pool.group_layers(group):
        held = pool.gpu_buffer(layer)[index]
        assert torch.equal(held, model.expected(layer, uniq)), f"layer {layer}: slot data differs"


def fill(pool: Pool, model: Model, addrs: list[int], seed: int = 0) -> None:
    """Write every address in every layer."""
    for layer in range(pool.config.num_layers):
        rows = rand_rows(len(addrs), model.bpl, seed * 1000 + layer)
        model.write(pool, layer, addr_tensor(addrs), rows)


# --------------------------------------------------------------------------------------------------
# layout, shapes, bookkeeping


def test_group_layout_last_group_short() -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=5, layers=3, lpg=2)
    assert pool.num_groups == 2
    assert list(pool.group_layers(0)) == [0, 1]
    assert list(pool.group_layers(1)) == [2]
    assert pool.capacity == 20
    assert pool.free_addresses == 20
    for layer in range(3):
        buf = pool.gpu_buffer(layer)
        assert buf.dtype == torch.uint8
        assert buf.shape == (7 + 1, 5)


def test_unwritten_rows_read_as_zeros_and_padding_rows_are_ignored() -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=12)
    model = Model(12)
    seq = pool.admit(num_tokens=5)
    addrs = seq.addresses.tolist()
    assert_reads(pool, model, addrs)  # nothing written yet: zeros everywhere
    # A -1 row is padding: ignored, whatever its bytes.
    model.write(pool, 0, addr_tensor([addrs[1], -1, addrs[3]]), rand_rows(3, 12, 1))
    # The other layer of the same group (1) and of the other group (2) still read zeros.
    assert_reads(pool, model, addrs)
    stats = pool.stats()
    assert stats["live_addresses"] == 5
    assert stats["distinct_entries"] == stats["physical_slots_used"] == 2


def test_extend_returns_the_new_addresses() -> None:
    pool = make_pool(gpu=7, cpu=13)
    seq = pool.admit(num_tokens=3)
    new = pool.extend(seq, 2)
    assert new.dtype == torch.int64
    assert len(seq) == 5
    assert torch.equal(seq.addresses[-2:], new)
    assert len(set(seq.addresses.tolist())) == 5
    empty = pool.extend(seq, 0)
    assert empty.numel() == 0 and len(seq) == 5
    assert pool.free_addresses == 15


# --------------------------------------------------------------------------------------------------
# capacity: exactly G + C tokens fit, one more does not


@pytest.mark.parametrize(
    ("bpl", "gpu", "cpu"),
    [(656, 7, 13), (12, 13, 7), (5, 7, 0)],
    ids=["b656-g7-c13", "b12-g13-c7", "b5-g7-c0-gpu-only"],
)
def test_capacity_is_exactly_gpu_plus_cpu(bpl: int, gpu: int, cpu: int) -> None:
    pool = make_pool(gpu=gpu, cpu=cpu, bpl=bpl, layers=3, lpg=2)
    model = Model(bpl)
    cap = gpu + cpu
    assert pool.capacity == cap
    first = cap // 3
    a = pool.admit(num_tokens=first)
    b = pool.admit(num_tokens=cap - first - 3)
    pool.extend(b, 2)
    pool.extend(a, 1)
    assert pool.free_addresses == 0
    addrs = a.addresses.tolist() + b.addresses.tolist()
    assert sorted(addrs) == list(range(cap)), "exactly the capacity's addresses, each once"

    before = pool.state_dict()
    for call in (
        lambda: pool.admit(num_tokens=1),
        lambda: pool.admit(num_tokens=cap),
        lambda: pool.extend(a, 1),
        lambda: pool.extend(b, 3),
    ):
        with pytest.raises(CapacityError):
            call()
        assert pool.free_addresses == 0
        assert len(a) == first + 1 and len(b) == cap - first - 1
        assert_same_state(before, pool.state_dict())
    assert pool.admit(num_tokens=0).addresses.numel() == 0  # zero tokens always fit

    fill(pool, model, addrs, seed=bpl)
    stats = pool.stats()
    groups = pool.num_groups
    assert stats["live_addresses"] == cap
    assert stats["distinct_entries"] == cap * groups
    assert stats["physical_slots_used"] == cap * groups  # ratio 1.0: one home per entry
    assert stats["gpu_slots_used"] == gpu * groups  # both tiers exactly full
    assert stats["cpu_slots_used"] == cpu * groups
    assert_reads(pool, model, addrs)
    pool.check_invariants()

    # Swap a full GPU's worth in from the CPU (GPU-only pool: re-select): still 1.0, still exact.
    res = pool.residency(0, addr_tensor(addrs)).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    chosen = (on_cpu + [x for x in addrs if x not in on_cpu])[:gpu]
    sel = pool.prepare(0, addr_tensor(chosen).view(1, -1))
    assert_selection_holds(pool, model, 0, addr_tensor(chosen).view(1, -1), sel.slots)
    stats = pool.stats()
    assert stats["distinct_entries"] == stats["physical_slots_used"] == cap * groups
    assert_reads(pool, model, addrs)

    pool.release(a)
    pool.release(b)
    assert pool.free_addresses == cap
    stats = pool.stats()
    assert stats["live_addresses"] == 0
    assert stats["physical_slots_used"] == stats["distinct_entries"] == 0
    assert stats["gpu_slots_used"] == stats["cpu_slots_used"] == 0
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# invariant 8: bad input raises the right error and changes nothing


@dataclass
class Loaded:
    pool: Pool
    model: Model
    seq: ulakv.address_space.Sequence
    gone: ulakv.address_space.Sequence
    live: torch.Tensor  # int64, 10 live addresses, all written in every layer
    dead: torch.Tensor  # int64, 4 released addresses

    @property
    def cap(self) -> int:
        return self.pool.capacity


def _loaded() -> Loaded:
    pool = make_pool(gpu=7, cpu=13, bpl=12, layers=3, lpg=2)
    model = Model(12)
    seq = pool.admit(num_tokens=10)
    gone = pool.admit(num_tokens=4)
    fill(pool, model, seq.addresses.tolist() + gone.addresses.tolist(), seed=3)
    pool.prepare(0, seq.addresses[:3].view(1, 3))
    live, dead = seq.addresses.clone(), gone.addresses.clone()
    pool.release(gone)
    model.forget(dead.tolist())
    return Loaded(pool, model, seq, gone, live, dead)


def _pair(x: torch.Tensor, y: int | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([[int(x), int(y)]], dtype=dtype)


BAD_CALLS: list[tuple[str, Callable[[Loaded], object], type[Exception] | tuple]] = [
    # prepare
    (
        "prepare-released",
        lambda s: s.pool.prepare(0, _pair(s.live[0], s.dead[0])),
        InvalidAddressError,
    ),
    (
        "prepare-released-int32",
        lambda s: s.pool.prepare(1, _pair(s.dead[1], s.live[1], torch.int32)),
        InvalidAddressError,
    ),
    (
        "prepare-addr-eq-capacity",
        lambda s: s.pool.prepare(0, _pair(s.live[0], s.cap)),
        InvalidAddressError,
    ),
    (
        "prepare-addr-above-capacity",
        lambda s: s.pool.prepare(1, _pair(s.cap + 100, s.live[2])),
        InvalidAddressError,
    ),
    (
        "prepare-addr-minus-2",
        lambda s: s.pool.prepare(0, _pair(s.live[0], -2)),
        InvalidAddressError,
    ),
    (
        "prepare-too-many-distinct",
        lambda s: s.pool.prepare(0, s.live[:8].view(1, 8)),
        CapacityError,
    ),
    (
        "prepare-too-many-distinct-across-rows",
        lambda s: s.pool.prepare(1, s.live[:8].view(2, 4)),
        CapacityError,
    ),
    (
        "prepare-too-many-distinct-bqk",
        lambda s: s.pool.prepare(0, torch.cat([s.live[:8], s.live[:4]]).view(2, 3, 2)),
        CapacityError,
    ),
    (
        "prepare-float32",
        lambda s: s.pool.prepare(0, s.live[:3].float().view(1, 3)),
        InvalidInputError,
    ),
    (
        "prepare-float64",
        lambda s: s.pool.prepare(1, s.live[:3].double().view(1, 3)),
        InvalidInputError,
    ),
    ("prepare-1d", lambda s: s.pool.prepare(0, s.live[:3]), InvalidInputError),
    ("prepare-0d", lambda s: s.pool.prepare(0, s.live[0]), InvalidInputError),
    ("prepare-4d", lambda s: s.pool.prepare(0, s.live[:4].view(1, 1, 2, 2)), InvalidInputError),
    ("prepare-group-too-big", lambda s: s.pool.prepare(2, s.live[:2].view(1, 2)), INDEX_ERRORS),
    ("prepare-group-negative", lambda s: s.pool.prepare(-1, s.live[:2].view(1, 2)), INDEX_ERRORS),
    # write
    (
        "write-float-rows",
        lambda s: s.pool.write(0, s.live[:2], torch.zeros(2, 12, dtype=torch.float32)),
        InvalidInputError,
    ),
    (
        "write-int8-rows",
        lambda s: s.pool.write(2, s.live[:2], torch.zeros(2, 12, dtype=torch.int8)),
        InvalidInputError,
    ),
    (
        "write-rows-too-wide",
        lambda s: s.pool.write(0, s.live[:2], rand_rows(2, 13, 0)),
        InvalidInputError,
    ),
    (
        "write-rows-too-narrow",
        lambda s: s.pool.write(1, s.live[:2], rand_rows(2, 11, 0)),
        InvalidInputError,
    ),
    (
        "write-rows-count-mismatch",
        lambda s: s.pool.write(0, s.live[:2], rand_rows(3, 12, 0)),
        InvalidInputError,
    ),
    (
        "write-rows-1d",
        lambda s: s.pool.write(0, s.live[:1], rand_rows(1, 12, 0)[0]),
        InvalidInputError,
    ),
    (
        "write-rows-meta-device",
        lambda s: s.pool.write(0, s.live[:2], torch.empty(2, 12, dtype=torch.uint8, device="meta")),
        InvalidInputError,
    ),
    (
        "write-addrs-float",
        lambda s: s.pool.write(0, s.live[:2].float(), rand_rows(2, 12, 0)),
        InvalidInputError,
    ),
    (
        "write-addrs-2d",
        lambda s: s.pool.write(0, s.live[:2].view(1, 2), rand_rows(2, 12, 0)),
        InvalidInputError,
    ),
    (
        "write-duplicate-addresses",
        lambda s: s.pool.write(0, s.live[[0, 1, 0]], rand_rows(3, 12, 0)),
        InvalidAddressError,
    ),
    (
        "write-duplicate-addresses-int32",
        lambda s: s.pool.write(2, s.live[[4, 4]].int(), rand_rows(2, 12, 0)),
        InvalidAddressError,
    ),
    (
        "write-released",
        lambda s: s.pool.write(1, torch.stack([s.live[0], s.dead[0]]), rand_rows(2, 12, 0)),
        InvalidAddressError,
    ),
    (
        "write-addr-eq-capacity",
        lambda s: s.pool.write(0, addr_tensor([int(s.live[0]), s.cap]), rand_rows(2, 12, 0)),
        InvalidAddressError,
    ),
    (
        "write-addr-minus-2",
        lambda s: s.pool.write(2, addr_tensor([-2, int(s.live[1])]), rand_rows(2, 12, 0)),
        InvalidAddressError,
    ),
    (
        "write-layer-too-big",
        lambda s: s.pool.write(3, s.live[:2], rand_rows(2, 12, 0)),
        INDEX_ERRORS,
    ),
    (
        "write-layer-negative",
        lambda s: s.pool.write(-1, s.live[:2], rand_rows(2, 12, 0)),
        INDEX_ERRORS,
    ),
    # release, extend, admit
    ("release-twice", lambda s: s.pool.release(s.gone), InvalidAddressError),
    ("extend-released-sequence", lambda s: s.pool.extend(s.gone, 1), INDEX_ERRORS),
    (
        "admit-over-capacity",
        lambda s: s.pool.admit(num_tokens=s.pool.free_addresses + 1),
        CapacityError,
    ),
    (
        "extend-over-capacity",
        lambda s: s.pool.extend(s.seq, s.pool.free_addresses + 1),
        CapacityError,
    ),
    ("admit-negative", lambda s: s.pool.admit(num_tokens=-1), INDEX_ERRORS),
    # read and the other slow-path accessors
    ("read-released", lambda s: s.pool.read(0, s.dead[:1]), InvalidAddressError),
    (
        "read-released-among-live",
        lambda s: s.pool.read(2, torch.stack([s.live[0], s.dead[2]])),
        InvalidAddressError,
    ),
    ("read-addr-eq-capacity", lambda s: s.pool.read(1, addr_tensor([s.cap])), InvalidAddressError),
    ("read-layer-too-big", lambda s: s.pool.read(3, s.live[:1]), INDEX_ERRORS),
    ("gpu-buffer-layer-too-big", lambda s: s.pool.gpu_buffer(3), INDEX_ERRORS),
    ("residency-group-too-big", lambda s: s.pool.residency(2, s.live[:1]), INDEX_ERRORS),
]


@pytest.mark.parametrize(("call", "exc"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(call: Callable[[Loaded], object], exc: type) -> None:
    s = _loaded()
    free = s.pool.free_addresses
    before = s.pool.state_dict()
    with pytest.raises(exc):
        call(s)
    assert_same_state(before, s.pool.state_dict())
    assert s.pool.free_addresses == free
    # Still fully usable and nothing lost.
    assert_reads(s.pool, s.model, s.live.tolist())
    s.pool.check_invariants()


CONFIG_CASES: list[tuple[str, Callable[[], object]]] = [
    ("gpu-slots-0", lambda: Tiered(gpu_slots=0, cpu_slots=4)),
    ("gpu-slots-negative", lambda: Tiered(gpu_slots=-7, cpu_slots=4)),
    ("gpu-slots-float", lambda: Tiered(gpu_slots=7.0, cpu_slots=4)),
    ("cpu-slots-negative", lambda: Tiered(gpu_slots=7, cpu_slots=-1)),
    ("bytes-per-layer-0", lambda: EntrySpec(bytes_per_layer=0)),
    ("bytes-per-layer-negative", lambda: EntrySpec(bytes_per_layer=-656)),
    ("layers-per-group-above-layers", lambda: pool_config(num_layers=3, layers_per_group=4)),
    ("layers-per-group-0", lambda: pool_config(layers_per_group=0)),
    ("num-layers-0", lambda: pool_config(num_layers=0, layers_per_group=1)),
    ("device-unknown", lambda: pool_config(device="banana")),
    ("device-unsupported-type", lambda: pool_config(device="xla")),
]


@pytest.mark.parametrize("build", [c[1] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_raises_config_error(build: Callable[[], object]) -> None:
    Pool(pool_config())  # the base the cases change is itself valid: each case fails for its change
    with pytest.raises(ConfigError):
        build()


# --------------------------------------------------------------------------------------------------
# no host sync on the hot path (validate=False)


def test_no_host_sync_patch_is_effective() -> None:
    t = torch.tensor([3, 1, 3])
    with no_host_sync():
        for call in (
            t[0].item,  # a one-element tensor: item on three elements fails before reading anything
            t.tolist,
            lambda: bool(t[0]),
            lambda: int(t[0]),
            lambda: torch.unique(t),
        ):
            with pytest.raises(HostSyncError):
                call()
        with pytest.raises(HostSyncError):
            t.nonzero()
    assert torch.unique(t).tolist() == [1, 3]  # undone


@skip_under_debug
def test_hot_path_never_syncs() -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=5, layers=3, lpg=2, validate=False)
    model = Model(5)
    a = pool.admit(num_tokens=9)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    # Inputs prepared before the patch (building them is the test's business, not the pool's).
    writes = []
    for layer in range(3):
        writes.append((layer, addr_tensor(A[:5]), rand_rows(5, 5, 10 + layer)))
    for layer in range(3):
        writes.append((layer, addr_tensor(A[5:] + B), rand_rows(10, 5, 20 + layer)))
    steps: list[tuple[str, int, torch.Tensor, torch.Tensor | None]] = [("w", *w) for w in writes]
    steps += [
        ("p", 0, addr_tensor([B[:4], [*A[:3], -1]]), None),  # B is on the CPU: swaps in, evicts A
        (
            "p",
            1,
            addr_tensor([[[B[0], B[1], -1], [B[1], B[2], B[5]]], [[A[8], -1, A[7]], [A[7], A[6], A[8]]]]),
            None,
        ),
        ("p", 0, addr_tensor([[A[5], A[6], A[7], -1], [B[4], B[5], B[4], -1]], torch.int32), None),
        ("w", 1, addr_tensor([A[0], -1, B[5]]), rand_rows(3, 5, 30)),
        ("w", 0, addr_tensor([B[0], A[1]], torch.int32), rand_rows(2, 5, 31)),
        ("p", 0, addr_tensor([[*A[:3], -1], B[:4]]), None),
        ("p", 1, addr_tensor([A[:6]]), None),
        ("w", 2, addr_tensor([A[2], B[3]]), rand_rows(2, 5, 32)),
        ("p", 1, addr_tensor([[A[2], B[3], -1]]), None),
    ]
    captured = []
    with no_host_sync():
        for kind, idx, addrs, rows in steps:
            if kind == "w":
                pool.write(idx, addrs, rows)
            else:
                sel = pool.prepare(idx, addrs)
                bufs = [pool.gpu_buffer(layer).clone() for layer in pool.group_layers(idx)]
                captured.append((sel.slots.clone(), bufs))
    pool.check()
    # Replay on the model and check every prepare's slots held the right bytes at that time.
    k = 0
    for kind, idx, addrs, rows in steps:
        if kind == "w":
            for x, row in zip(addrs.tolist(), rows, strict=True):
                if x >= 0:
                    model.rows[(idx, x)] = row.clone()
            continue
        slots, bufs = captured[k]
        k += 1
        assert slots.shape == addrs.shape and slots.dtype == torch.int32
        assert torch.equal(slots == -1, addrs == -1)
        mask = addrs >= 0
        for layer, buf in zip(pool.group_layers(idx), bufs, strict=True):
            got = buf[slots[mask].long()]
            assert torch.equal(got, model.expected(layer, addrs[mask].tolist())), (k, layer)
    stats = pool.stats()
    assert stats["victims"] > 0 and stats["bytes_in"] > 0 and stats["bytes_out"] > 0
    assert stats["distinct_entries"] == stats["physical_slots_used"]
    assert_reads(pool, model, A + B)
    pool.check_invariants()


@pytest.mark.parametrize("op", ["prepare", "write"], ids=["prepare-released", "write-released"])
def test_deferred_error_without_validation(op: str) -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=12, layers=3, lpg=2, validate=False)
    model = Model(12)
    a = pool.admit(num_tokens=5)
    b = pool.admit(num_tokens=3)
    fill(pool, model, a.addresses.tolist() + b.addresses.tolist(), seed=5)
    dead = b.addresses.tolist()
    pool.release(b)
    pool.check()  # nothing wrong yet
    before = pool.state_dict()
    bad = addr_tensor([int(a.addresses[0]), dead[1]])
    if op == "prepare":
        pool.prepare(0, bad.view(1, 2))  # does not raise: the error is recorded on the device
    else:
        pool.write(2, bad, rand_rows(2, 12, 6))
    # Only the recorded error itself ("pending": the deferred status word) may differ.
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    with pytest.raises(InvalidAddressError):
        pool.check()
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    assert_reads(pool, model, a.addresses.tolist())
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# fast path, padding, duplicates


SELECTIONS: list[tuple[str, torch.dtype, Callable[[list[int], list[int]], list]]] = [
    ("bk-2x3", torch.int64, lambda a, b: [a[:3], b[:3]]),
    ("bk-1x6-int32", torch.int32, lambda a, b: [a[2:8]]),
    (
        "bqk-2x3x3-overlap",
        torch.int64,
        lambda a, b: [[a[0:3], a[1:4], a[2:5]], [b[0:3], b[0:3], [b[3], -1, b[0]]]],
    ),
    (
        "bqk-1x2x4-padded",
        torch.int32,
        lambda a, b: [[[a[7], -1, a[8], -1], [-1, a[8], a[9], a[7]]]],
    ),
]


@pytest.mark.parametrize(("dtype", "build"), [c[1:] for c in SELECTIONS], ids=[c[0] for c in SELECTIONS])
def test_second_prepare_is_all_hits_and_moves_nothing(dtype: torch.dtype, build: Callable) -> None:
    pool = make_pool(gpu=13, cpu=7, bpl=12, layers=3, lpg=2)
    model = Model(12)
    a = pool.admit(num_tokens=10)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    fill(pool, model, A + B, seed=7)  # 16 entries a group, 13 GPU slots: 3 on the CPU
    topk = addr_tensor(build(A, B), dtype)
    rows = topk.view(topk.shape[0], -1)
    distinct_per_request = [sorted({x for x in r.tolist() if x >= 0}) for r in rows]
    n_distinct = sum(len(d) for d in distinct_per_request)
    for group in range(pool.num_groups):
        flat = [x for d in distinct_per_request for x in d]
        resident = sum(r >= 0 for r in pool.residency(group, addr_tensor(flat)).tolist())
        s0 = pool.stats()
        first = pool.prepare(group, topk)
        assert first.group == group
        s1 = pool.stats()
        assert s1["hits"] - s0["hits"] == resident
        assert s1["misses"] - s0["misses"] == n_distinct - resident
        assert_selection_holds(pool, model, group, topk, first.slots)
        second = pool.prepare(group, topk)
        s2 = pool.stats()
        assert torch.equal(second.slots, first.slots)
        assert s2["hits"] - s1["hits"] == n_distinct
        assert s2["misses"] == s1["misses"]
        for key in ("bytes_in", "bytes_out", "victims", "distinct_entries", "physical_slots_used"):
            assert s2[key] == s1[key], key
        assert_selection_holds(pool, model, group, topk, second.slots)
    assert_reads(pool, model, A + B)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_padding_shapes_and_duplicates(dtype: torch.dtype) -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=5, layers=3, lpg=2)
    model = Model(5)
    a = pool.admit(num_tokens=6)
    b = pool.admit(num_tokens=6)
    A, B = a.addresses.tolist(), b.addresses.tolist()
    fill(pool, model, A + B, seed=11)

    # All padding: all -1, nothing counted or moved.
    s0 = pool.stats()
    pad = pool.prepare(1, torch.full((2, 3, 4), -1, dtype=dtype))
    assert pad.slots.shape == (2, 3, 4) and pad.slots.dtype == torch.int32
    assert bool((pad.slots == -1).all())
    s1 = pool.stats()
    for key in ("hits", "misses", "bytes_in", "bytes_out", "victims"):
        assert s1[key] == s0[key], key

    # [B=2, Q=3, K=4]: request 0 repeats 3 addresses across its 3 query positions, request 1 uses 4;
    # 24 entries, 7 distinct = G: fits, because duplicates count once.
    topk = addr_tensor(
        [
            [[A[0], A[1], -1, A[2]], [A[2], A[0], A[1], -1], [-1, -1, A[1], A[1]]],
            [[B[3], B[4], B[5], B[0]], [B[0], -1, B[3], B[4]], [B[5], B[5], B[5], B[5]]],
        ],
        dtype,
    )
    sel = pool.prepare(0, topk)
    s2 = pool.stats()
    assert (s2["hits"] - s1["hits"]) + (s2["misses"] - s1["misses"]) == 3 + 4
    assert_selection_holds(pool, model, 0, topk, sel.slots)

    # [B, K] with more entries than GPU slots but few distinct addresses.
    wide = addr_tensor([[B[1], B[2]] * 8 + [-1]], dtype)
    sel = pool.prepare(1, wide)
    s3 = pool.stats()
    assert (s3["hits"] - s2["hits"]) + (s3["misses"] - s2["misses"]) == 2
    assert_selection_holds(pool, model, 1, wide, sel.slots)
    assert_reads(pool, model, A + B)


def test_write_to_cpu_home_stays_on_cpu() -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=656, layers=3, lpg=2)
    model = Model(656)
    seq = pool.admit(num_tokens=12)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=13)
    res = pool.residency(1, seq.addresses).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    assert len(on_cpu) == 12 - 7
    s0 = pool.stats()
    model.write(pool, 2, addr_tensor(on_cpu[:3]), rand_rows(3, 656, 14))
    s1 = pool.stats()
    assert pool.residency(1, seq.addresses).tolist() == res  # written where it lives: no move
    for key in ("bytes_in", "victims"):
        assert s1[key] == s0[key], key
    # The rows themselves may count as GPU->CPU traffic (on a GPU they come from device memory);
    # nothing else may leave the GPU.
    assert s1["bytes_out"] - s0["bytes_out"] in (0, 3 * 656)
    assert_reads(pool, model, addrs)


# --------------------------------------------------------------------------------------------------
# invariant 4: what the current round selected is not evicted by writes in that round


def test_selected_entries_survive_writes_in_the_same_round() -> None:
    pool = make_pool(gpu=7, cpu=13, bpl=12, layers=3, lpg=2)
    model = Model(12)
    seq = pool.admit(num_tokens=10)
    addrs = seq.addresses.tolist()
    fill(pool, model, addrs, seed=17)  # group 0: 7 on the GPU (full), 3 on the CPU
    res = pool.residency(0, seq.addresses).tolist()
    on_cpu = [x for x, r in zip(addrs, res, strict=True) if r < 0]
    on_gpu = [x for x, r in zip(addrs, res, strict=True) if r >= 0]
    chosen = on_cpu[:2] + on_gpu[:3]  # 5 selected: 2 swap in, 2 unselected residents stay evictable
    topk = addr_tensor([chosen])
    sel = pool.prepare(0, topk)
    assert_selection_holds(pool, model, 0, topk, sel.slots)

    new = pool.extend(seq, 5).tolist()  # same round: extend does not start one
    for layer in (0, 1):
        model.write(pool, layer, addr_tensor(new), rand_rows(5, 12, 18 + layer))
    assert_selection_holds(pool, model, 0, topk, sel.slots)  # still there, same slots
    res_new = pool.residency(0, addr_tensor(new)).tolist()
    # The two unselected GPU residents could be evicted for new entries; the selected ones not.
    assert sum(r >= 0 for r in res_new) == 2
    stats = pool.stats()
    assert stats["gpu_slots_used"] == 7 + min(7, 10)  # group 0 full; group 1 (layer 2) full
    assert stats["distinct_entries"] == stats["physical_slots_used"]
    assert_reads(pool, model, addrs + new)
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# ExactLRU: a hand-worked example


def test_exact_lru_victims_hand_worked() -> None:
    pool = make_pool(gpu=3, cpu=4, bpl=5, layers=1, lpg=1)
    model = Model(5)
    seq = pool.admit(num_tokens=4)
    a, b, c, d = seq.addresses.tolist()

    def where(*xs: int) -> list[int]:
        return pool.residency(0, addr_tensor(list(xs))).tolist()

    def select(*xs: int) -> torch.Tensor:
        topk = addr_tensor([list(xs)])
        slots = pool.prepare(0, topk).slots
        assert_selection_holds(pool, model, 0, topk, slots)
        return slots

    model.write(pool, 0, addr_tensor([a, b, c]), rand_rows(3, 5, 21))  # three free GPU slots
    assert all(r >= 0 for r in where(a, b, c))
    slot_of = dict(zip((a, b, c), where(a, b, c), strict=True))
    select(a)  # round 1
    select(b)  # round 2
    select(c)  # round 3
    s0 = pool.stats()
    # d is new and the GPU is full: c is protected (this round), a is the least recently used.
    model.write(pool, 0, addr_tensor([d]), rand_rows(1, 5, 22))
    assert where(a, b, c) == [-1, slot_of[b], slot_of[c]]
    assert where(d)[0] >= 0
    s1 = pool.stats()
    assert s1["victims"] - s0["victims"] == 1
    assert s1["bytes_out"] - s0["bytes_out"] == 5
    assert s1["bytes_in"] == s0["bytes_in"]

    # Round 4 brings a back: b (round 2) is older than c and d (round 3).
    select(a)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    s2 = pool.stats()
    assert s2["victims"] - s1["victims"] == 1 and s2["misses"] - s1["misses"] == 1
    assert s2["bytes_in"] - s1["bytes_in"] == 5 and s2["bytes_out"] - s1["bytes_out"] == 5

    # Round 5 selects b and c: c is protected, d (round 3) is older than a (round 4).
    select(b, c)
    assert where(d) == [-1]
    assert all(r >= 0 for r in where(a, b, c))
    s3 = pool.stats()
    assert s3["hits"] - s2["hits"] == 1 and s3["misses"] - s2["misses"] == 1

    # Round 6 selects d: a (round 4) is the oldest resident.
    select(d)
    assert where(a) == [-1]

    # Within a round, recency follows the first position in the selection (row-major).
    # Round 7 selects a: b and c were both used in round 5, b at the earlier position: b leaves.
    select(a)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    # Round 8 selects b, then a (b first although its address is larger): c (round 5) leaves.
    assert b > a
    select(b, a)
    assert where(c) == [-1]
    # Round 9 selects c and d: of b and a (both round 8) b came first, so b leaves, not a.
    select(c, d)
    assert where(b) == [-1]
    assert all(r >= 0 for r in where(a, c, d))
    assert_reads(pool, model, [a, b, c, d])
    pool.check_invariants()


@skip_under_debug
def test_admission_extend_and_release_never_sync() -> None:
    """Per-step bookkeeping stays off the device's critical path too: host lists in, async copies."""
    pool = make_pool(gpu=5, cpu=9, bpl=4, layers=2, lpg=1, validate=False)
    with no_host_sync():
        seq = pool.admit(num_tokens=3)
        new = pool.extend(seq, 2)
        pool.write(0, new, torch.zeros((2, 4), dtype=torch.uint8))
        other = pool.admit(num_tokens=4)
        pool.release(seq)
        pool.release(other)
    assert new.tolist() == [3, 4]
    assert pool.free_addresses == pool.capacity
    pool.check_invariants()
