"""Shared test helpers: small pools of every kind, random rows, a model of the rows written, a loaded
pool to start from, and bit-exact comparison of state."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch

from ulakv import (
    PBLRU,
    CPUOffloadBaseline,
    EntrySpec,
    ExactLRU,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    PoolConfig,
    Replicated,
    Sequence,
    Tiered,
)
from ulakv.address_space import LogicalAllocator
from ulakv.invariants import check_invariants
from ulakv.kernels import common as K
from ulakv.kernels import release as release_mod
from ulakv.layouts.tiered_state import TieredState

# The API names no class for a layer or group index out of range, nor for a bad token count; these
# are input errors, so either input-error class of ulakv is accepted (never a bare IndexError).
INDEX_ERRORS = (InvalidInputError, InvalidAddressError)
# The traffic counters of ``Pool.stats()`` (docs/design.md, section 5).
STAT_COUNTERS = ("hits", "misses", "bytes_in", "bytes_out", "victims")
# The single-process pool kinds: ulakv's exclusive two-tier pool and the two baselines.
KINDS = ("tiered", "replicated", "offload")


def pool_config(**changes) -> PoolConfig:
    """A small valid config (5-byte entries, 3 layers in groups of 2, 7 GPU slots) with ``changes``."""
    base = dict(
        entry=EntrySpec(bytes_per_layer=5),
        num_layers=3,
        layers_per_group=2,
        layout=Tiered(gpu_slots=7, cpu_slots=0),
    )
    return PoolConfig(**{**base, **changes})


def small_pool(
    gpu_slots: int = 5,
    cpu_slots: int = 9,
    bytes_per_layer: int = 6,
    num_layers: int = 3,
    layers_per_group: int = 2,
    policy=None,
    **kwargs,
) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=bytes_per_layer),
            num_layers=num_layers,
            layers_per_group=layers_per_group,
            layout=Tiered(gpu_slots=gpu_slots, cpu_slots=cpu_slots, policy=policy or ExactLRU()),
            **kwargs,
        )
    )


def offload_config(
    cpu: int = 17,
    quota: int = 3,
    requests: int = 2,
    bpl: int = 12,
    layers: int = 3,
    lpg: int = 2,
    device: str = "cpu",
) -> PoolConfig:
    """A ``CPUOffloadBaseline`` pool's config: ``cpu`` addresses, ``requests`` buffers of ``quota``."""
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
    """A ``Replicated(world)`` pool's config: ``gpu`` addresses, each held by every replica."""
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=bpl),
        num_layers=layers,
        layers_per_group=lpg,
        layout=Replicated(world=world, gpu_slots=gpu),
        device=device,
    )


def random_rows(gen: torch.Generator | int, n: int, width: int, *, strided: bool = False) -> torch.Tensor:
    """``n`` rows of ``width`` random bytes drawn from ``gen`` (a generator, or a seed for a fresh one).
    ``strided`` gives a non-contiguous view: every other column of rows twice as wide."""
    if isinstance(gen, int):
        gen = torch.Generator().manual_seed(gen)
    if strided:
        return torch.randint(0, 256, (n, 2 * width), dtype=torch.uint8, generator=gen)[:, ::2]
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)


def row_of(address: int, layer: int, version: int, width: int) -> torch.Tensor:
    """``width`` bytes distinct per (address, layer, version): a stale row from an address's
    earlier life (an older version) or another layer's row reads differently."""
    return ((torch.arange(width) * 7 + address * 131 + layer * 29 + version * 13) % 251).to(torch.uint8)


def policy_cases(buckets: int) -> list:
    """Both policies as pytest parameters, ids ``lru`` and ``pblru<buckets>``: exact LRU, and PB-LRU
    with ``buckets`` buckets (a test's pools decide how many make its rounds interesting)."""
    return [pytest.param(ExactLRU(), id="lru"), pytest.param(PBLRU(buckets), id=f"pblru{buckets}")]


def addr_tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@dataclass
class RowModel:
    """What a pool must hold: {(layer, address): row}; unwritten rows read as zeros."""

    bpl: int
    rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def write(self, pool: Pool, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
        pool.write(layer, addrs, rows)
        self.record(layer, addrs, rows)

    def record(self, layer: int, addrs: torch.Tensor, rows: torch.Tensor) -> None:
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


def fill(pool: Pool, model: RowModel, addrs: list[int], seed: int = 0) -> None:
    """Write every address in every layer (layer ``l``'s rows from seed ``1000 * seed + l``)."""
    for layer in range(pool.config.num_layers):
        model.write(pool, layer, addr_tensor(addrs), random_rows(seed * 1000 + layer, len(addrs), model.bpl))


def assert_reads(pool: Pool, model: RowModel, addrs: list[int]) -> None:
    """Invariant 2: every address reads back exactly what the model says, in every layer."""
    if not addrs:
        return
    for layer in range(pool.config.num_layers):
        got = pool.read(layer, addr_tensor(addrs))
        assert got.dtype == torch.uint8
        assert got.shape == (len(addrs), model.bpl)
        assert torch.equal(got, model.expected(layer, addrs)), f"layer {layer} read-back differs"


def assert_selection_holds(
    pool: Pool, model: RowModel, group: int, topk: torch.Tensor, slots: torch.Tensor
) -> None:
    """Invariant 3 on a tiered pool: every selected address is GPU-resident, ``residency`` agrees,
    and its slot holds its bytes in every layer of the group."""
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


def snapshot(pool: Pool, live: list[int]) -> dict:
    """Everything observable about a pool: counters, free addresses, every layer's GPU buffer, the
    bytes of the ``live`` addresses, and (a tiered pool) ``state_dict()``. Equal snapshots (launch
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


def expect_rejected(pool: Pool, exc: type | tuple, call: Callable[[], object], live: list[int]) -> None:
    """Invariant 8: ``call`` raises ``exc`` and the pool is exactly as it was."""
    before = snapshot(pool, live)
    with pytest.raises(exc):
        call()
    assert_same_state(before, snapshot(pool, live))


# --------------------------------------------------------------------------------------------------
# a loaded pool of each kind, the state the bad-input table and the API tests start from


LOADED_CONFIGS: dict[str, Callable[[], PoolConfig]] = {
    # 14 entries a group over 7 GPU slots: half of them live on the CPU.
    "tiered": lambda: pool_config(
        entry=EntrySpec(bytes_per_layer=12), layout=Tiered(gpu_slots=7, cpu_slots=13)
    ),
    "replicated": lambda: replicated_config(world=3, gpu=17),
    # Two request buffers of 3 (quota 3): the writes alone overflow them.
    "offload": lambda: offload_config(cpu=17, quota=3, requests=2),
}


@dataclass
class Loaded:
    """A pool of 12-byte rows, 3 layers in groups {0, 1} and {2}, after traffic: ``seq`` (10
    addresses) and ``gone`` (4) written in every layer, some of both selected in both groups, then
    ``gone`` released."""

    pool: Pool
    model: RowModel  # every live address's rows
    seq: Sequence
    gone: Sequence
    live: torch.Tensor  # int64, seq's 10 addresses
    dead: torch.Tensor  # int64, gone's 4 released addresses

    @property
    def cap(self) -> int:
        return self.pool.capacity


def _build_loaded(kind: str) -> Loaded:
    pool = Pool(LOADED_CONFIGS[kind]())
    model = RowModel(12)
    seq = pool.admit(num_tokens=10)
    gone = pool.admit(num_tokens=4)
    fill(pool, model, seq.addresses.tolist() + gone.addresses.tolist(), seed=3)
    pool.prepare(0, seq.addresses[:3].view(1, 3))
    pool.prepare(1, torch.stack([seq.addresses[3:5], gone.addresses[:2]]))
    live, dead = seq.addresses.clone(), gone.addresses.clone()
    pool.release(gone)
    model.forget(dead.tolist())
    return Loaded(pool, model, seq, gone, live, dead)


_LOADED: dict[str, Loaded] = {}


def loaded_pool(kind: str) -> Loaded:
    """A deep copy of one loaded pool of ``kind``, its sequences and model with it (building it runs
    ~16 interpreted kernels; the bad-input table would build it over a hundred times)."""
    if kind not in _LOADED:
        _LOADED[kind] = _build_loaded(kind)
    return copy.deepcopy(_LOADED[kind])


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str = "") -> None:
    """Bitwise equality of two dicts of tensors (GPU data compared without the dummy slot)."""
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key == "gpu_data":
            x, y = x[:, :-1], y[:, :-1]
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{where}{key}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}"
        )
        assert torch.equal(x, y), f"{where}{key} differs:\n{x}\n{y}"


def release_against_reference(pool: Pool, seq) -> None:
    """Release ``seq`` through the kernel and, on a copy of the state, through its reference: the
    two states must agree word for word; the allocator takes the addresses back."""
    st_ref = pool.internals().state.clone()
    release_mod.release(seq.addresses, pool.internals().state)
    release_mod.release_reference(seq.addresses, st_ref)
    assert_tensors_equal(pool.internals().state.tensors(), st_ref.tensors(), "release: ")
    pool.internals().allocator.give_back(seq.runs)
    seq.released = True


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bit equality (NaN payloads and -0.0 included)."""
    t = t.detach().contiguous().reshape(-1)
    if t.is_floating_point() or t.is_complex():
        return t.view(torch.uint8)
    return t


def assert_same_state(
    before: object, after: object, path: str = "state", ignore: tuple[str, ...] = ()
) -> None:
    """``state_dict()`` snapshots are bit-identical (the host-side launch counter excepted, and
    keys containing any of ``ignore``)."""
    if isinstance(before, dict):
        assert isinstance(after, dict), path
        assert before.keys() == after.keys(), f"{path}: keys changed"
        for key in before:
            if any(word in str(key) for word in ("launch", *ignore)):
                continue
            assert_same_state(before[key], after[key], f"{path}[{key!r}]", ignore)
    elif isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), path
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            assert_same_state(a, b, f"{path}[{i}]", ignore)
    elif isinstance(before, torch.Tensor):
        assert isinstance(after, torch.Tensor), path
        assert before.dtype == after.dtype, f"{path}: dtype {before.dtype} -> {after.dtype}"
        assert before.shape == after.shape, f"{path}: shape {before.shape} -> {after.shape}"
        assert torch.equal(_bits(before), _bits(after)), f"{path} changed"
    else:
        assert before == after, f"{path}: {before!r} -> {after!r}"


def assert_holds_nothing(state: TieredState) -> None:
    """What the release kernel alone must leave once every entry of ``state`` is released: no
    address homed, every GPU slot unowned, both free lists full (each slot once), no bucket bit."""
    G, C = state.gpu_slots, state.cpu_slots
    assert not bool((state.mapping >= 0).any()), "an address still has a home"
    assert bool((state.owner == -1).all()), "a GPU slot is still owned"
    for g in range(state.num_groups):
        n_gpu, n_cpu = int(state.gctl[g, int(K.G_GPU_FREE)]), int(state.gctl[g, int(K.G_CPU_FREE)])
        assert (n_gpu, n_cpu) == (G, C), f"group {g}: free stacks hold {n_gpu}/{G} GPU, {n_cpu}/{C} CPU"
        ids = torch.arange(max(G, C), dtype=torch.int32, device=state.gpu_free.device)
        assert torch.equal(state.gpu_free[g, :G].sort().values, ids[:G]), f"group {g}: GPU free stack"
        cpu_free = state.free_cpu_rows(g).to(ids.device)
        assert torch.equal(cpu_free.sort().values, ids[:C]), f"group {g}: CPU free list"
    assert not bool(state.bits.any()), "a PB-LRU bucket still lists a slot"


@contextlib.contextmanager
def looking_behind_reset() -> Iterator[list[TieredState]]:
    """A pool (or a buffer) puts its policy state back to fresh once nothing is left in it (invariant
    6, exactly); that reset would also hide a release kernel that leaks slots. Inside this block every
    reset first checks that the release kernels had already freed everything; yields the states
    reset, so a test can tell it looked."""
    reset, seen = TieredState.reset_residency, []

    def checked_reset(state: TieredState) -> None:
        assert_holds_nothing(state)
        check_invariants(state, LogicalAllocator(state.num_addresses))  # a fresh one: nothing live
        seen.append(state)
        reset(state)

    with mock.patch.object(TieredState, "reset_residency", checked_reset):
        yield seen
