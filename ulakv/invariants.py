"""Whole-state checks of DESIGN section 4, run on the host (they synchronise; tests and
``ULAKV_DEBUG=1`` use them, the hot path never does)."""

from __future__ import annotations

import torch

from .address_space import FREE, LogicalAllocator
from .errors import InvariantError
from .kernels import common as K
from .kernels.buckets import PBLRUBits


def _fail(group: int, message: str) -> None:
    raise InvariantError(f"group {group}: {message}")


def check_invariants(state, allocator: LogicalAllocator) -> None:
    """Raise InvariantError unless every live address has exactly one home, the free stacks and
    slot owners agree with the mapping, and every GPU entry sits exactly once in the LRU order."""
    G, C, N = state.gpu_slots, state.cpu_slots, state.num_addresses
    live = torch.ones(N, dtype=torch.bool)
    for run in allocator.free_runs():
        live[run.start : run.stop] = False
    for g in range(state.num_groups):
        mapping = state.mapping[g].cpu().to(torch.int64)
        owner = state.owner[g].cpu().to(torch.int64)
        gctl = state.gctl[g].cpu().tolist()
        if bool((mapping[~live] != FREE).any()):
            _fail(g, "an address that is not live still has a mapping")
        if bool((mapping[live] == FREE).any()):
            _fail(g, "a live address is marked free")
        if bool(((mapping < -2) | (mapping >= G + C)).any()):
            _fail(g, "a mapping value is out of range")
        homed = torch.nonzero(mapping >= 0).flatten()
        homes = mapping[homed]
        if homes.unique().numel() != homes.numel():
            _fail(g, "two addresses share one home")  # invariant 1
        on_gpu = homes < G
        if not torch.equal(owner[homes[on_gpu]], homed[on_gpu]):
            _fail(g, "a GPU slot's owner disagrees with the mapping")
        owned = torch.nonzero(owner >= 0).flatten()
        if not torch.equal(mapping[owner[owned]], owned):
            _fail(g, "a GPU slot is owned by an address that does not map to it")
        n_gpu_free, n_cpu_free = gctl[int(K.G_GPU_FREE)], gctl[int(K.G_CPU_FREE)]
        gpu_free = state.gpu_free[g, :n_gpu_free].cpu().to(torch.int64)
        expected_gpu_free = torch.nonzero(owner < 0).flatten()
        if not torch.equal(gpu_free.sort().values, expected_gpu_free):
            _fail(g, "the GPU free stack does not list exactly the unowned slots")
        cpu_used = torch.zeros(max(C, 1), dtype=torch.bool)
        cpu_used[homes[~on_gpu] - G] = True
        cpu_free = state.cpu_free[g, :n_cpu_free].cpu().to(torch.int64)
        expected_cpu_free = torch.nonzero(~cpu_used[:C]).flatten()
        if not torch.equal(cpu_free.sort().values, expected_cpu_free):
            _fail(g, "the CPU free stack does not list exactly the unused CPU slots")
        if state.policy == K.EXACT_LRU:
            _check_lru_ring(state, g, owner, gctl)
        else:
            _check_buckets(state, g, owner, gctl)


def _check_lru_ring(state, g: int, owner: torch.Tensor, gctl: list[int]) -> None:
    G = state.gpu_slots
    head, tail = gctl[int(K.G_HEAD)], gctl[int(K.G_TAIL)]
    round_tail, qcap = gctl[int(K.G_ROUND_TAIL)], state.q_slot.shape[1]
    if not head <= round_tail <= tail or tail - head > qcap:
        _fail(g, f"LRU queue bounds broken: head {head}, round tail {round_tail}, tail {tail}")
    idx = torch.arange(head, tail) % qcap
    q_slot = state.q_slot[g].cpu().to(torch.int64)[idx]
    q_ver = state.q_ver[g].cpu()[idx]
    valid = q_ver == state.ver[g].cpu()[q_slot]
    counts = torch.bincount(q_slot[valid], minlength=G)
    if not torch.equal(counts, (owner >= 0).to(torch.int64)):
        _fail(g, "a GPU entry is missing from the LRU order, or a free slot is in it")


def _check_buckets(state, g: int, owner: torch.Tensor, gctl: list[int]) -> None:
    """PB-LRU: every occupied slot is in exactly the bucket its stamp names, free slots in none,
    and every summary bit says exactly whether the word below it is non-empty."""
    bitmaps = PBLRUBits(state, g)
    ref = gctl[int(K.G_ROUND)] + 1
    stamps = state.stamp[g].cpu().tolist()
    where = {}
    for b, slots in enumerate(bitmaps.sets):
        for s in slots:
            if s in where:
                _fail(g, f"slot {s} is in buckets {where[s]} and {b}")
            where[s] = b
    for s in range(state.gpu_slots):
        occupied = int(owner[s]) >= 0
        if occupied != (s in where):
            _fail(
                g,
                f"slot {s}: occupied is {occupied}, in a bucket is {not occupied}",
            )
        expected = bitmaps.bucket_of(stamps[s], ref) if occupied else None
        if occupied and where[s] != expected:
            _fail(g, f"slot {s} sits in bucket {where[s]}, its stamp {stamps[s]} says {expected}")
    if not torch.equal(bitmaps.packed(), state.bits[g].cpu()):
        _fail(g, "a PB-LRU summary bit disagrees with the words below it")
