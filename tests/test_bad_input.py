"""Bad input raises the documented error and changes nothing (``docs/design.md``, section 4,
invariant 8; the errors of each call: section 5).

One table of bad calls, each made on a copy of a loaded pool of every kind it applies to (the tiered
pool and both baselines, ``helpers.loaded_pool``): the call raises the documented class, every
observable (counters, free addresses, every GPU buffer, the live addresses' bytes, ``state_dict``)
is bit-identical afterwards, nothing is lost, and the pool still admits. A row names the kinds it
applies to only when it does not apply to all. One table of bad configurations, each refused with
``ConfigError`` while the base it changes is valid. A pool that does not validate records the
error on the device instead and raises it at the next synchronising call, changing nothing else.

The offload baseline's own limits (quota, requests, CPU rows) with what still fits beside them:
``tests/test_offload.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from helpers import (
    INDEX_ERRORS,
    KINDS,
    Loaded,
    RowModel,
    addr_tensor,
    assert_reads,
    assert_same_state,
    expect_rejected,
    fill,
    loaded_pool,
    pool_config,
    random_rows,
)
from nosync import skip_under_debug

from ulakv import (
    CapacityError,
    ConfigError,
    CPUOffloadBaseline,
    EntrySpec,
    InvalidAddressError,
    InvalidInputError,
    Pool,
    Replicated,
    Tiered,
)


def _pair(x: int | torch.Tensor, y: int | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([[int(x), int(y)]], dtype=dtype)


def _rows(n: int, width: int = 12) -> torch.Tensor:
    return random_rows(7, n, width)


class Bad(NamedTuple):
    name: str
    call: Callable[[Loaded], object]
    exc: type[Exception] | tuple[type[Exception], ...]
    kinds: tuple[str, ...] = KINDS


# ``s`` is a loaded pool (``helpers.Loaded``): 10 live addresses, 4 released, 12-byte rows, 3 layers
# in groups {0, 1} and {2}; capacity 20 (tiered: 7 GPU + 13 CPU slots) or 17 (both baselines).
BAD_CALLS: list[Bad] = [
    # prepare: addresses
    Bad("prepare-released", lambda s: s.pool.prepare(0, _pair(s.live[0], s.dead[0])), InvalidAddressError),
    Bad(
        "prepare-released-int32",
        lambda s: s.pool.prepare(1, _pair(s.dead[1], s.live[1], torch.int32)),
        InvalidAddressError,
    ),
    Bad(
        "prepare-addr-eq-capacity", lambda s: s.pool.prepare(0, _pair(s.live[0], s.cap)), InvalidAddressError
    ),
    Bad(
        "prepare-addr-above-capacity",
        lambda s: s.pool.prepare(1, _pair(s.cap + 100, s.live[2])),
        InvalidAddressError,
    ),
    Bad(
        "prepare-never-admitted-last-address",
        lambda s: s.pool.prepare(0, _pair(s.live[0], s.cap - 1)),
        InvalidAddressError,
    ),
    Bad("prepare-addr-minus-2", lambda s: s.pool.prepare(0, _pair(s.live[0], -2)), InvalidAddressError),
    # prepare: more distinct addresses than one call may hold: 8 > the tiered pool's 7 GPU slots, 8 of
    # one request > the offload's quota of 3. Not Replicated: its 17 slots outnumber the live addresses.
    Bad(
        "prepare-too-many-distinct",
        lambda s: s.pool.prepare(0, s.live[:8].view(1, 8)),
        CapacityError,
        ("tiered", "offload"),
    ),
    Bad(
        "prepare-too-many-distinct-across-rows",
        lambda s: s.pool.prepare(1, s.live[:8].view(2, 4)),
        CapacityError,
        ("tiered", "offload"),
    ),
    Bad(
        "prepare-too-many-distinct-bqk",
        lambda s: s.pool.prepare(0, torch.cat([s.live[:8], s.live[:4]]).view(2, 3, 2)),
        CapacityError,
        ("tiered", "offload"),
    ),
    # prepare: types, shapes, devices, groups
    Bad("prepare-float32", lambda s: s.pool.prepare(0, s.live[:3].float().view(1, 3)), InvalidInputError),
    Bad("prepare-float64", lambda s: s.pool.prepare(1, s.live[:3].double().view(1, 3)), InvalidInputError),
    Bad("prepare-int16", lambda s: s.pool.prepare(0, s.live[:3].short().view(1, 3)), InvalidInputError),
    Bad("prepare-list", lambda s: s.pool.prepare(0, [[0, 1]]), InvalidInputError),
    Bad("prepare-0d", lambda s: s.pool.prepare(0, s.live[0]), InvalidInputError),
    Bad("prepare-1d", lambda s: s.pool.prepare(0, s.live[:3]), InvalidInputError),
    Bad("prepare-4d", lambda s: s.pool.prepare(0, s.live[:4].view(1, 1, 2, 2)), InvalidInputError),
    Bad(
        "prepare-meta-device",
        lambda s: s.pool.prepare(0, torch.zeros(1, 2, dtype=torch.int64, device="meta")),
        InvalidInputError,
    ),
    Bad("prepare-group-too-big", lambda s: s.pool.prepare(2, s.live[:2].view(1, 2)), INDEX_ERRORS),
    Bad("prepare-group-negative", lambda s: s.pool.prepare(-1, s.live[:2].view(1, 2)), INDEX_ERRORS),
    # write: rows
    Bad("write-float-rows", lambda s: s.pool.write(0, s.live[:2], torch.zeros(2, 12)), InvalidInputError),
    Bad("write-int8-rows", lambda s: s.pool.write(2, s.live[:2], _rows(2).to(torch.int8)), InvalidInputError),
    Bad("write-rows-too-wide", lambda s: s.pool.write(0, s.live[:2], _rows(2, 13)), InvalidInputError),
    Bad("write-rows-too-narrow", lambda s: s.pool.write(1, s.live[:2], _rows(2, 11)), InvalidInputError),
    Bad("write-rows-count-mismatch", lambda s: s.pool.write(0, s.live[:2], _rows(3)), InvalidInputError),
    Bad("write-rows-1d", lambda s: s.pool.write(0, s.live[:1], _rows(1)[0]), InvalidInputError),
    Bad(
        "write-rows-meta-device",
        lambda s: s.pool.write(0, s.live[:2], torch.empty(2, 12, dtype=torch.uint8, device="meta")),
        InvalidInputError,
    ),
    # write: addresses
    Bad(
        "write-addrs-meta-device",
        lambda s: s.pool.write(0, torch.zeros(2, dtype=torch.int64, device="meta"), _rows(2)),
        InvalidInputError,
    ),
    Bad("write-addrs-float", lambda s: s.pool.write(0, s.live[:2].float(), _rows(2)), InvalidInputError),
    Bad("write-addrs-2d", lambda s: s.pool.write(0, s.live[:2].view(1, 2), _rows(2)), InvalidInputError),
    Bad(
        "write-duplicate-addresses",
        lambda s: s.pool.write(0, s.live[[0, 1, 0]], _rows(3)),
        InvalidAddressError,
    ),
    Bad(
        "write-duplicate-addresses-int32",
        lambda s: s.pool.write(2, s.live[[4, 4]].int(), _rows(2)),
        InvalidAddressError,
    ),
    Bad(
        "write-duplicates-int32-padded",
        lambda s: s.pool.write(
            2, addr_tensor([-1, int(s.live[4]), -1, int(s.live[4])], torch.int32), _rows(4)
        ),
        InvalidAddressError,
    ),
    Bad(
        "write-released",
        lambda s: s.pool.write(1, torch.stack([s.live[0], s.dead[0]]), _rows(2)),
        InvalidAddressError,
    ),
    Bad(
        "write-addr-eq-capacity",
        lambda s: s.pool.write(0, addr_tensor([int(s.live[0]), s.cap]), _rows(2)),
        InvalidAddressError,
    ),
    Bad(
        "write-addr-minus-2",
        lambda s: s.pool.write(2, addr_tensor([-2, int(s.live[1])]), _rows(2)),
        InvalidAddressError,
    ),
    Bad("write-layer-too-big", lambda s: s.pool.write(3, s.live[:2], _rows(2)), INDEX_ERRORS),
    Bad("write-layer-negative", lambda s: s.pool.write(-1, s.live[:2], _rows(2)), INDEX_ERRORS),
    # release, extend, admit
    Bad("release-twice", lambda s: s.pool.release(s.gone), InvalidAddressError),
    Bad("extend-released-sequence", lambda s: s.pool.extend(s.gone, 1), INDEX_ERRORS),
    Bad("admit-over-capacity", lambda s: s.pool.admit(num_tokens=s.pool.free_addresses + 1), CapacityError),
    Bad("extend-over-capacity", lambda s: s.pool.extend(s.seq, s.pool.free_addresses + 1), CapacityError),
    Bad("admit-negative", lambda s: s.pool.admit(num_tokens=-1), InvalidInputError),
    Bad("admit-fractional", lambda s: s.pool.admit(num_tokens=2.5), InvalidInputError),
    Bad("admit-float", lambda s: s.pool.admit(num_tokens=2.0), INDEX_ERRORS),
    # read and the other slow-path accessors
    Bad("read-released", lambda s: s.pool.read(0, s.dead[:1]), InvalidAddressError),
    Bad(
        "read-released-among-live",
        lambda s: s.pool.read(2, torch.stack([s.live[0], s.dead[2]])),
        InvalidAddressError,
    ),
    Bad("read-padding", lambda s: s.pool.read(1, addr_tensor([int(s.live[0]), -1])), InvalidAddressError),
    Bad("read-addr-eq-capacity", lambda s: s.pool.read(1, addr_tensor([s.cap])), InvalidAddressError),
    Bad("read-float", lambda s: s.pool.read(0, s.live[:2].float()), InvalidInputError),
    Bad("read-layer-too-big", lambda s: s.pool.read(3, s.live[:1]), INDEX_ERRORS),
    Bad("gpu-buffer-layer-too-big", lambda s: s.pool.gpu_buffer(3), INDEX_ERRORS),
    Bad("residency-group-too-big", lambda s: s.pool.residency(2, s.live[:1]), INDEX_ERRORS),
    Bad("residency-float", lambda s: s.pool.residency(0, s.live[:2].float()), InvalidInputError),
    Bad("residency-list", lambda s: s.pool.residency(0, [0, 1]), InvalidInputError),
]


@pytest.mark.parametrize(
    ("kind", "call", "exc"),
    [pytest.param(kind, b.call, b.exc, id=f"{b.name}-{kind}") for b in BAD_CALLS for kind in b.kinds],
)
def test_bad_input_raises_and_changes_nothing(kind: str, call: Callable[[Loaded], object], exc) -> None:
    s = loaded_pool(kind)
    live = s.live.tolist()
    expect_rejected(s.pool, exc, lambda: call(s), live)
    assert_reads(s.pool, s.model, live)  # nothing lost
    s.pool.admit(num_tokens=1)  # still usable, and everything still checks out
    s.pool.check_invariants()


@skip_under_debug  # a deferred error needs validate=False, which ULAKV_DEBUG overrides
@pytest.mark.parametrize("kind", ["tiered", "replicated"])  # the offload baseline validates on the host
@pytest.mark.parametrize("op", ["prepare", "write"], ids=["prepare-released", "write-released"])
def test_deferred_error_without_validation(op: str, kind: str) -> None:
    layout = Tiered(gpu_slots=7, cpu_slots=13) if kind == "tiered" else Replicated(world=3, gpu_slots=20)
    pool = Pool(pool_config(entry=EntrySpec(bytes_per_layer=12), layout=layout, validate=False))
    model = RowModel(12)
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
        pool.write(2, bad, random_rows(6, 2, 12))
    # Only the recorded error itself ("pending": the deferred status word) may differ.
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    # The error names the call refused and its layer group.
    where = (
        "prepare of layer group 0" if op == "prepare" else f"write to layer group {pool.config.group_of(2)}"
    )
    with pytest.raises(InvalidAddressError, match=f"an earlier {where} \\(refused"):
        pool.check()
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    assert_reads(pool, model, a.addresses.tolist())
    pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# bad configurations


LAYOUTS: dict[str, Callable[[], object]] = {  # valid: each case below changes one thing
    "tiered": lambda: Tiered(gpu_slots=7, cpu_slots=4),
    "replicated": lambda: Replicated(world=3, gpu_slots=13),
    "offload": lambda: CPUOffloadBaseline(cpu_slots=17, slots_per_request=3, max_requests=2),
}

# (name, kinds, build(the kind's valid layout)); kinds (None,): no layout involved.
CONFIG_CASES: list[tuple[str, tuple[str | None, ...], Callable[[object], object]]] = [
    # PoolConfig: the same mistake under every kind's layout
    (
        "layers-per-group-above-layers",
        KINDS,
        lambda lay: pool_config(layout=lay, num_layers=3, layers_per_group=4),
    ),
    ("layers-per-group-0", KINDS, lambda lay: pool_config(layout=lay, layers_per_group=0)),
    ("num-layers-0", KINDS, lambda lay: pool_config(layout=lay, num_layers=0, layers_per_group=1)),
    ("device-unknown", KINDS, lambda lay: pool_config(layout=lay, device="banana")),
    ("device-unsupported-type", KINDS, lambda lay: pool_config(layout=lay, device="xla")),
    ("validate-not-a-bool", KINDS, lambda lay: pool_config(layout=lay, validate="yes")),
    # EntrySpec
    ("bytes-per-layer-0", (None,), lambda _: EntrySpec(bytes_per_layer=0)),
    ("bytes-per-layer-negative", (None,), lambda _: EntrySpec(bytes_per_layer=-656)),
    # each layout's own parameters
    ("gpu-slots-0", ("tiered",), lambda _: Tiered(gpu_slots=0, cpu_slots=4)),
    ("gpu-slots-negative", ("tiered",), lambda _: Tiered(gpu_slots=-7, cpu_slots=4)),
    ("gpu-slots-float", ("tiered",), lambda _: Tiered(gpu_slots=7.0, cpu_slots=4)),
    ("cpu-slots-negative", ("tiered",), lambda _: Tiered(gpu_slots=7, cpu_slots=-1)),
    ("world-0", ("replicated",), lambda _: Replicated(world=0, gpu_slots=13)),
    ("world-negative", ("replicated",), lambda _: Replicated(world=-3, gpu_slots=13)),
    ("world-float", ("replicated",), lambda _: Replicated(world=3.0, gpu_slots=13)),
    ("world-bool", ("replicated",), lambda _: Replicated(world=True, gpu_slots=13)),
    ("gpu-0", ("replicated",), lambda _: Replicated(world=3, gpu_slots=0)),
    ("gpu-str", ("replicated",), lambda _: Replicated(world=3, gpu_slots="13")),
    ("gpu-too-many-for-int32", ("replicated",), lambda _: Replicated(world=3, gpu_slots=2**31)),
    ("cpu-0", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=0)),
    ("cpu-negative", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=-5)),
    ("cpu-float", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17.0)),
    ("cpu-str", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots="17")),
    ("cpu-bool", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=True)),
    ("cpu-too-many-for-int32", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=2**31)),
    ("quota-0", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, slots_per_request=0)),
    ("quota-float", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, slots_per_request=3.5)),
    ("quota-none", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, slots_per_request=None)),
    ("requests-0", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, max_requests=0)),
    ("requests-negative", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, max_requests=-1)),
    ("requests-float", ("offload",), lambda _: CPUOffloadBaseline(cpu_slots=17, max_requests=2.0)),
    (
        "requests-x-quota-too-big-for-int32-slots",
        ("offload",),
        lambda _: CPUOffloadBaseline(17, slots_per_request=2**20, max_requests=2**12),
    ),
]


@pytest.mark.parametrize(
    ("kind", "build"),
    [
        pytest.param(kind, build, id=f"{kind}-{name}" if kind else name)
        for name, kinds, build in CONFIG_CASES
        for kind in kinds
    ],
)
def test_bad_config_raises_config_error(kind: str | None, build: Callable[[object], object]) -> None:
    # The base each case changes is itself valid: each case fails for its change.
    Pool(pool_config(layout=LAYOUTS[kind or "tiered"]()))
    with pytest.raises(ConfigError):
        build(LAYOUTS[kind or "tiered"]())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA: the pool is built")
def test_a_cuda_pool_without_cuda_is_a_config_error_naming_the_device() -> None:
    from ulakv import ConfigError, EntrySpec, Pool, PoolConfig, Tiered

    config = PoolConfig(entry=EntrySpec(8), num_layers=1, layout=Tiered(gpu_slots=4), device="cuda")
    with pytest.raises(ConfigError, match=r"PoolConfig.device is 'cuda'.*device='cpu'"):
        Pool(config)


def test_a_refused_write_says_which_addresses_are_out_of_range_and_which_not_live() -> None:
    from ulakv import EntrySpec, InvalidAddressError, Pool, PoolConfig, Tiered

    pool = Pool(PoolConfig(entry=EntrySpec(8), num_layers=1, layout=Tiered(gpu_slots=4)))
    pool.admit(2)
    rows = torch.zeros((3, 8), dtype=torch.uint8)
    with pytest.raises(InvalidAddressError, match=r"out of range \[0, 4\): \[9\]; not live: \[3\]"):
        pool.write(0, torch.tensor([1, 3, 9]), rows)
    with pytest.raises(InvalidAddressError, match=r"addresses not live: \[3\]; nothing changed"):
        pool.write(0, torch.tensor([3]), rows[:1])
