"""The host-sync detector itself (``tests/nosync.py``): every kind of device read-back planted in a
small function is an error under it, the operations a sync-free hot path is made of are not, the
Triton interpreter's own host copies are exempt without hiding ours, and a read-back planted in a
pool's ``prepare`` is caught."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from nosync import (
    _ULAKV_DIR,
    HostSyncError,
    _triton_dir,
    is_device_to_host,
    no_host_sync,
    skip_under_debug,
    sync_reason,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import ulakv.layouts.tiered
from ulakv import CapacityError, EntrySpec, ExactLRU, InvalidAddressError, Pool, PoolConfig, Striped, Tiered
from ulakv.spawn import run_ranks

aten = torch.ops.aten

T = torch.tensor([3, 1, 3, -1, 0, 2])
MASK = T >= 0
IDX = torch.tensor([2, 0, 5])
ZERO_D = torch.tensor(1)


def _assign_mask() -> None:
    t = T.clone()
    t[MASK] = 0


# Each plants one read-back (every tensor it needs is built at import, outside the detector).
SYNCS: dict[str, Callable[[], object]] = {
    "item": lambda: T[0].item(),
    "bool": lambda: bool(T[0]),
    "int": lambda: int(T[0]),
    "float": lambda: float(T[0]),
    "index-list-by-0d-tensor": lambda: [1, 2, 3][ZERO_D],
    "index-tensor-by-0d-tensor": lambda: T[ZERO_D],
    "if-tensor": lambda: 1 if T[0] > 0 else 0,
    "contains": lambda: 3 in T,
    "format-0d": lambda: f"{T[0]}",
    "scalar-arg-from-tensor": lambda: torch.full((2,), T[0]),
    "narrow-tensor-start": lambda: T.narrow(0, ZERO_D, 2),
    "equal": lambda: torch.equal(T, T),
    "allclose": lambda: torch.allclose(T.float(), T.float()),
    "nonzero": lambda: torch.nonzero(T),
    "nonzero-method": lambda: T.nonzero(),
    "nonzero-as-tuple": lambda: T.nonzero(as_tuple=True),
    "argwhere": lambda: torch.argwhere(T),
    "where-one-arg": lambda: torch.where(MASK),
    "masked_select": lambda: torch.masked_select(T, MASK),
    "masked_select-method": lambda: T.masked_select(MASK),
    "bool-mask-index": lambda: T[T >= 0],
    "uint8-mask-index": lambda: T[MASK.to(torch.uint8)],
    "bool-mask-assign": _assign_mask,
    "index_put_-bool": lambda: T.clone().index_put_((MASK,), torch.tensor(0)),
    "unique": lambda: torch.unique(T),
    "unique-method": lambda: T.unique(),
    "unique-unsorted": lambda: torch.unique(T, sorted=False, return_inverse=True),
    "unique-dim": lambda: torch.unique(T, dim=0),
    "_unique": lambda: torch._unique(T),
    "unique_consecutive": lambda: torch.unique_consecutive(T),
    "unique_consecutive-dim": lambda: torch.unique_consecutive(T, dim=0),
    "bincount": lambda: torch.bincount(IDX),
    "bincount-minlength": lambda: torch.bincount(IDX, minlength=8),
    "repeat_interleave-tensor": lambda: torch.repeat_interleave(IDX),
    "repeat_interleave-method": lambda: T[:3].repeat_interleave(IDX),
    "one_hot-no-classes": lambda: torch.nn.functional.one_hot(IDX),
    "histc-range-from-data": lambda: torch.histc(T.float(), bins=4),
    "linalg-check-errors": lambda: torch.linalg.inv(torch.eye(2)),
    "to_sparse": lambda: T.to_sparse(),
    "tolist": lambda: T.tolist(),
    "numpy": lambda: T.numpy(),
    "np.asarray": lambda: np.asarray(T),
    "repr": lambda: repr(T),
    "print": lambda: str(T),
    "cuda.synchronize": lambda: torch.cuda.synchronize(),
    "accelerator.synchronize": lambda: torch.accelerator.synchronize(),
}

# A sync-free hot path is made of these.
FINE: dict[str, Callable[[], object]] = {
    "index-by-int-tensor": lambda: T[IDX],
    "index-by-int": lambda: T[1],
    "slice": lambda: T[1:4],
    "index-assign-int-tensor": lambda: T.clone().index_put_((IDX,), torch.tensor(7)),
    "index_select": lambda: T.index_select(0, IDX),
    "gather": lambda: T.gather(0, IDX),
    "scatter": lambda: torch.zeros(6, dtype=T.dtype).scatter(0, IDX, T[:3]),
    "index_copy_": lambda: torch.zeros(6, dtype=T.dtype).index_copy_(0, IDX, T[:3]),
    "where": lambda: torch.where(MASK, T, -1),
    "masked_fill-scalar": lambda: T.masked_fill(~MASK, 0),
    "masked_fill-cpu-0d": lambda: T.masked_fill(~MASK, torch.tensor(0)),
    "cumsum": lambda: T.cumsum(0),
    "sort": lambda: T.sort(),
    "topk": lambda: T.topk(2),
    "argmax": lambda: T.argmax(),
    "any-as-tensor": lambda: (T > 2).any(),
    "nonzero_static": lambda: torch.nonzero_static(T, size=6),
    "arithmetic": lambda: (T * 2 + 1) // 3 % 5,
    "compare": lambda: (T >= 0) & (T % 2 == 1),
    "full": lambda: torch.full((3,), -1, dtype=torch.int32),
    "clamp": lambda: T.clamp(min=0),
    "view-reshape": lambda: T.view(2, 3).reshape(3, 2).t().contiguous(),
    "repeat_interleave-output_size": lambda: torch.repeat_interleave(IDX, output_size=7),
    "repeat_interleave-int": lambda: T.repeat_interleave(2),
    "histc-fixed-range": lambda: torch.histc(T.float(), bins=4, min=-1, max=3),
    "cat-stack": lambda: torch.stack([torch.cat([T, T]), torch.cat([T, T])]),
    "to-dtype": lambda: T.to(torch.int32),
    "cpu-on-cpu": lambda: T.cpu(),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_every_read_back_is_an_error(name: str) -> None:
    with no_host_sync(), pytest.raises(HostSyncError):
        SYNCS[name]()


@pytest.mark.parametrize("name", list(FINE))
def test_device_side_work_passes(name: str) -> None:
    with no_host_sync():
        FINE[name]()


def test_the_detector_is_undone_after_the_block() -> None:
    repr_before = torch.Tensor.__repr__
    with pytest.raises(RuntimeError, match="inside"), no_host_sync():
        raise RuntimeError("inside")
    assert "tolist" not in vars(torch.Tensor) and "numpy" not in vars(torch.Tensor)
    assert torch.Tensor.__repr__ is repr_before
    assert T.tolist()[0] == 3 and bool(T[0]) and torch.unique(T).numel() == 5 and T[MASK].numel() == 5


# -- device-to-host copies, decided on device descriptions (fake CUDA tensors on any machine) --------


def test_device_to_host_decision() -> None:
    cuda, cpu, meta = torch.device("cuda", 0), torch.device("cpu"), torch.device("meta")
    assert is_device_to_host(cuda, cpu)
    assert is_device_to_host("cuda:1", "cpu")
    assert is_device_to_host(torch.device("xpu"), cpu) and is_device_to_host(torch.device("mps"), cpu)
    assert not is_device_to_host(cpu, cuda)  # host to device: asynchronous
    assert not is_device_to_host(cuda, cuda) and not is_device_to_host(cuda, torch.device("cuda", 1))
    assert not is_device_to_host(cpu, cpu) and not is_device_to_host(meta, cpu)


@contextlib.contextmanager
def fake_cuda() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Fake tensors on "cuda" (metadata only: no GPU needed): a vector, a mask and a 0-d value."""
    with FakeTensorMode():
        x = torch.zeros(4, device="cuda")
        yield x, x > 0, torch.zeros((), device="cuda")


def test_sync_reason_on_device_descriptions() -> None:
    with fake_cuda() as (x, mask, value):
        cpu = torch.zeros(4)
        assert sync_reason(aten._to_copy.default, (x,), {"device": torch.device("cpu")})
        assert sync_reason(aten._to_copy.default, (x,), {"dtype": torch.float16}) is None  # stays on cuda
        assert sync_reason(aten._to_copy.default, (cpu,), {"device": torch.device("cuda")}) is None
        assert sync_reason(aten.copy_.default, (cpu, x))
        assert sync_reason(aten.copy_.default, (x, cpu)) is None
        assert sync_reason(aten.copy_.default, (x, x)) is None
        assert sync_reason(aten._copy_from.default, (x, cpu))
        assert sync_reason(aten._copy_from.default, (cpu, x)) is None
        assert sync_reason(aten.fill_.Tensor, (cpu, value))
        assert sync_reason(aten.fill_.Tensor, (x, value)) is None
        assert sync_reason(aten.masked_fill.Tensor, (x, mask, value))  # the kernel calls value.item()
        assert sync_reason(aten.masked_fill.Tensor, (x, mask, torch.tensor(0.0))) is None
        assert sync_reason(aten.masked_fill.Scalar, (x, mask, 0.0)) is None


D2H: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "cpu()": lambda x, m, v: x.cpu(),
    "to-cpu-non_blocking": lambda x, m, v: x.to("cpu", non_blocking=True),
    "copy_-into-cpu": lambda x, m, v: torch.empty(4).copy_(x),
    "copy_-non_blocking-into-pageable": lambda x, m, v: torch.empty(4).copy_(x, non_blocking=True),
    "cpu-fill_-device-value": lambda x, m, v: torch.empty(4).fill_(v),
    "masked_fill-device-value": lambda x, m, v: x.masked_fill(m, v),
    "item": lambda x, m, v: v.item(),
    "tolist": lambda x, m, v: x.tolist(),
}
D2D: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]] = {
    "plus-cpu-0d": lambda x, m, v: x + torch.zeros(()),
    "clone": lambda x, m, v: x.clone(),
    "masked_fill-scalar": lambda x, m, v: x.masked_fill(m, 1.0),
    "where": lambda x, m, v: torch.where(m, x, v),
}


@pytest.mark.parametrize("name", list(D2H))
def test_device_to_host_is_an_error(name: str) -> None:
    with fake_cuda() as (x, mask, value), no_host_sync(), pytest.raises(HostSyncError):
        D2H[name](x, mask, value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_a_non_blocking_copy_into_pinned_memory_passes() -> None:
    """The one device-to-host copy that is not a sync (``ulakv.deferred``): asynchronous, into
    pinned memory, read only once an event says it landed."""
    x = torch.zeros(4, device="cuda")
    pinned = torch.empty(4, pin_memory=True)
    with no_host_sync():
        pinned.copy_(x, non_blocking=True)
    with no_host_sync(), pytest.raises(HostSyncError):
        pinned.copy_(x)


@pytest.mark.parametrize("name", list(D2D))
def test_device_work_passes(name: str) -> None:
    """(Host-to-device copies are judged above: fake tensors cannot copy to "cuda" without CUDA.)"""
    with fake_cuda() as (x, mask, value), no_host_sync():
        D2D[name](x, mask, value)


# -- the Triton interpreter's exemption ----------------------------------------------------------


def _compiled_in(directory: str, source: str) -> dict[str, object]:
    """Functions whose frames look like they belong to ``directory`` (no file is written)."""
    namespace: dict[str, object] = {}
    exec(compile(source, os.path.join(directory, "_nosync_probe.py"), "exec"), namespace)
    return namespace


TRITON = _compiled_in(
    _triton_dir(),
    "def read(t):\n    return t.item(), t.tolist(), t.cpu().numpy()\ndef call(f, t):\n    return f(t)\n",
)
ULAKV = _compiled_in(_ULAKV_DIR, "def grid(t):\n    return (int(t),)\n")


def test_triton_reading_tensors_is_exempt() -> None:
    with no_host_sync():
        TRITON["read"](T[:1])  # the interpreter copying a tensor to the host
        with pytest.raises(HostSyncError):  # and the exemption ends with triton's frame
            T[0].item()


def test_a_sync_in_our_code_called_by_triton_is_caught() -> None:
    """A grid function or hook is called by triton, but the innermost of our frames is ulakv's or
    the tests': the sync is ours."""
    with no_host_sync():
        with pytest.raises(HostSyncError):
            TRITON["call"](ULAKV["grid"], T[0])
        with pytest.raises(HostSyncError):
            TRITON["call"](lambda t: t.tolist(), T)


# -- pools ---------------------------------------------------------------------------------------

WIDTH, LAYERS = 8, 2


def _config(layout) -> PoolConfig:
    return PoolConfig(
        entry=EntrySpec(bytes_per_layer=WIDTH),
        num_layers=LAYERS,
        layers_per_group=LAYERS,
        layout=layout,
        device="cpu",
        validate=False,  # prepare and write do not read the status back
    )


def _filled(pool: Pool, n: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    seq = pool.admit(num_tokens=n)
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 256, (n, WIDTH), dtype=torch.uint8, generator=gen) for _ in range(LAYERS)]
    for layer in range(LAYERS):
        pool.write(layer, seq.addresses, rows[layer])
    a = seq.addresses
    pick = torch.tensor([[0, 2, 0, -1], [0, 1, 2, 3]])  # 4 distinct: the most one prepare may select
    topk = torch.where(pick >= 0, a[pick.clamp(min=0)], -1)
    return a, rows, topk


@skip_under_debug
def test_tiered_prepare_and_write_do_not_sync() -> None:
    """Every path of the hot path under the detector: a write of new entries (no GPU slot left: they
    get CPU homes), a rewrite in place, and a prepare whose misses come in from the CPU and evict."""
    pool = Pool(_config(Tiered(gpu_slots=4, cpu_slots=8, policy=ExactLRU())))
    addrs, rows, _ = _filled(pool, 6)  # addrs[:4] on the GPU, addrs[4:] on the CPU
    later = pool.extend(pool.admit(num_tokens=0), 2)
    fresh = [torch.full((2, WIDTH), 50 + layer, dtype=torch.uint8) for layer in range(LAYERS)]
    new = torch.full((2, WIDTH), 7, dtype=torch.uint8)
    topk = torch.stack([addrs[[4, 0, 5, 0]], torch.stack([later[0], addrs[0], addrs[4], addrs[0]])])
    topk[:, 3] = -1  # 4 distinct (the most a prepare may select): 1 hit, 3 misses from the CPU
    before = pool.stats()
    with no_host_sync():
        for layer in range(LAYERS):
            pool.write(layer, later, fresh[layer])
        pool.write(1, addrs[1:3], new)
        sel = pool.prepare(0, topk)
    after = pool.stats()
    assert after["misses"] - before["misses"] == 3 and after["hits"] - before["hits"] == 1
    assert after["victims"] - before["victims"] == 3 and after["bytes_in"] > before["bytes_in"]
    pool.check_invariants()
    want = {int(a): [rows[layer][i] for layer in range(LAYERS)] for i, a in enumerate(addrs)}
    want.update({int(a): [fresh[layer][i] for layer in range(LAYERS)] for i, a in enumerate(later)})
    for i in (1, 2):
        want[int(addrs[i])][1] = new[i - 1]
    for a, slot in zip(topk.flatten().tolist(), sel.slots.flatten().tolist(), strict=True):
        assert (slot == -1) == (a == -1)
        if a >= 0:
            for layer in range(LAYERS):
                assert torch.equal(pool.gpu_buffer(layer)[slot], want[a][layer]), (a, layer)


def test_a_mask_index_planted_in_prepare_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The acceptance case: ``topk[topk >= 0]`` (a boolean-mask index: its shape is data) in the
    tiered prepare."""
    pool = Pool(_config(Tiered(gpu_slots=4, cpu_slots=8, policy=ExactLRU())))
    _, _, topk = _filled(pool, 6)
    original = ulakv.layouts.tiered.TieredPool.prepare

    def planted(self, group, topk):
        topk[topk >= 0]  # the planted defect
        return original(self, group, topk)

    monkeypatch.setattr(ulakv.layouts.tiered.TieredPool, "prepare", planted)
    with no_host_sync(), pytest.raises(HostSyncError, match=r"aten\.index\.Tensor"):
        pool.prepare(0, topk)


def _striped_rank(rank: int, world: int, attention: str) -> dict:
    """One rank of a world-2 striped pool (validate=False): writes of new entries (some get CPU
    homes), a rewrite, and two prepares whose misses come from the CPU and evict, all under the
    detector; then a refusal raised through the deferred path."""
    buffer = dict(buffer_slots=8) if attention == "fetch" else {}
    inner = Tiered(gpu_slots=4, cpu_slots=8, policy=ExactLRU())  # a home brings in at most 4 a call
    pool = Pool(_config(Striped(world=world, rank=rank, attention=attention, inner=inner, **buffer)))
    addrs = pool.admit(num_tokens=16).addresses  # 8 a rank: 4 on its GPU, 4 on its CPU
    rows = [
        (torch.arange(16 * WIDTH).view(16, WIDTH) * (layer + 3) % 251).to(torch.uint8) for layer in range(2)
    ]
    new = torch.full((2, WIDTH), 7, dtype=torch.uint8)
    # 4 distinct a home (its limit): the CPU-homed ones miss and evict the GPU-homed ones.
    first = addrs[[8, 9, 10, 11, 12, 13, 14, 15]].view(2, 4)
    second = torch.stack([addrs[[0, 1, 8, -1]], addrs[[2, 3, 0, 9]]])
    with no_host_sync():
        for layer in range(LAYERS):
            pool.write(layer, addrs, rows[layer])
        pool.write(1, addrs[[1, 2]], new)
    rows[1][[1, 2]] = new
    checked = 0
    for topk in (first, second):
        with no_host_sync():
            slots = pool.prepare(0, topk).slots
        # Read before the next prepare, which may reuse the buffer's slots.
        for a, slot in zip(topk.flatten().tolist(), slots.flatten().tolist(), strict=True):
            homed_here = a >= 0 and a % world == rank
            assert (slot >= 0) == (a >= 0 and (homed_here or attention == "fetch")), (a, slot)
            if slot >= 0:
                for layer in range(LAYERS):
                    assert torch.equal(pool.gpu_buffer(layer)[slot], rows[layer][a]), (a, layer)
                    checked += 1
    stats = pool.stats()
    pool.check_invariants()
    # Five distinct addresses homed on rank 0 in one call: refused on the device, raised at the
    # next call on every rank alike, nothing changed.
    too_many = addrs[[0, 2, 4, 6, 8, -1]].view(1, 6)
    with no_host_sync():
        refused = pool.prepare(0, too_many).slots
    kept = [pool.gpu_buffer(layer).clone() for layer in range(LAYERS)]
    with pytest.raises(CapacityError, match="homed on one rank") as raised:
        pool.prepare(0, second)
    assert all(torch.equal(pool.gpu_buffer(layer), kept[layer]) for layer in range(LAYERS))
    # A refused fetch still runs its all-gather (padding) and its kernels (which change nothing).
    wire = ("bytes_communicated", "collectives", "bytes_in", "launches")
    after = pool.stats()
    changed = {k: (stats[k], v) for k, v in after.items() if k not in wire and v != stats[k]}
    assert not changed, changed
    assert torch.equal(pool.prepare(0, second).slots, slots)  # still in service, same slots
    return {
        "checked": checked,
        "misses": stats["misses"],
        "refused": refused.tolist(),
        "error": str(raised.value),
    }


@skip_under_debug
@pytest.mark.parametrize("attention", ["fetch", "local"])
def test_striped_prepare_and_write_do_not_sync(attention: str) -> None:
    """World 2 on gloo, both attention modes: the whole hot path of a striped rank, and a refusal."""
    results = run_ranks(_striped_rank, 2, attention)
    assert all(r["checked"] > 0 and r["misses"] > 0 for r in results)
    assert all(r["refused"] == [[-1] * 6] for r in results)  # a refused call's slots
    assert results[0]["error"] == results[1]["error"]  # the same refusal on every rank


@skip_under_debug
def test_engine_owned_addresses_do_not_sync() -> None:
    """An engine's decode step without validation (the CUDA default): make the new tokens' slots live,
    write them, select them, give some back, and refuse a slot live twice, all under the detector; the
    refusal changes nothing and is raised by the next call."""
    config = _config(Tiered(gpu_slots=4, cpu_slots=8, policy=ExactLRU())).replace(
        engine_addresses=32, validate=False
    )
    pool = Pool(config)
    locs = torch.tensor([9, 3, -1, 17])
    rows = torch.arange(4 * WIDTH, dtype=torch.uint8).view(4, WIDTH)
    with no_host_sync():
        pool.admit_addresses(locs)
        for layer in range(LAYERS):
            pool.write(layer, locs, rows)
        sel = pool.prepare(0, locs.view(1, -1))
        pool.release_addresses(torch.tensor([3, -1]))
        pool.admit_addresses(torch.tensor([9]))  # live already: refused on the device
    assert pool.state_dict()["engine_live"].tolist() == [2]
    with pytest.raises(InvalidAddressError, match="live already"):
        pool.admit_addresses(torch.tensor([5]))
    for a, slot in zip(locs.tolist(), sel.slots.flatten().tolist(), strict=True):
        assert (slot == -1) == (a == -1)
    assert torch.equal(pool.gpu_buffer(0)[sel.slots.flatten()[[0, 3]].long()], rows[[0, 3]])
    pool.check_invariants()
