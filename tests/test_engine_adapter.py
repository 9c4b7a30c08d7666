"""The engine adapter: launches and host syncs per group-step, fixed buffers, the prefetch split.

Launches are counted at Triton's launch entry (``count_launches``), not by the pool's bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator

import pytest
import torch
from helpers import assert_same_state, policy_cases, random_rows
from nosync import no_host_sync, skip_under_debug
from torch.utils._python_dispatch import TorchDispatchMode

from ulakv import (
    PBLRU,
    CapacityError,
    EntrySpec,
    ExactLRU,
    InvalidAddressError,
    InvalidInputError,
    NewRows,
    Pool,
    PoolConfig,
    Tiered,
)
from ulakv.engine import SparseKV
from ulakv.kernels._triton import count_launches

WIDTH, LAYERS, PER_GROUP = 8, 5, 3  # groups of 3 and 2 layers
POLICIES = policy_cases(4)


@contextlib.contextmanager
def torch_ops() -> Iterator[list[str]]:
    """The names of the torch operators ulakv's code runs inside the block (not those the Triton
    interpreter runs to hand a launch its arguments: a GPU launch runs no torch operator)."""
    ran: list[str] = []

    def in_triton() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not in_triton():
                ran.append(str(func))
            return func(*args, **(kwargs or {}))

    with Recording():
        yield ran


def engine(
    policy, gpu: int, cpu: int, *, max_batch: int, top_k: int, queries: int = 1, prefetch=True, validate=False
):
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=LAYERS,
            layers_per_group=PER_GROUP,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=policy),
            validate=validate,
        )
    )
    kv = SparseKV(pool, max_batch=max_batch, top_k=top_k, max_queries=queries, prefetch=prefetch)
    return pool, kv


def fill(pool: Pool, kv: SparseKV, requests: int, tokens: int, seed: int = 0):
    """Admit ``requests`` requests of ``tokens`` tokens and write every layer; returns the
    sequences and the expected bytes per (layer, address)."""
    gen = torch.Generator().manual_seed(seed)
    seqs, expected = [], {}
    for _ in range(requests):
        seq = pool.admit(tokens)
        seqs.append(seq)
        for layer in range(LAYERS):
            rows = random_rows(gen, tokens, WIDTH)
            kv.write(layer, seq.addresses, rows)
            expected.update({(layer, a): r for a, r in zip(seq.addresses.tolist(), rows, strict=True)})
    return seqs, expected


def selection(rng: random.Random, seqs, batch: int, queries: int, k: int) -> torch.Tensor:
    rows = []
    for b in range(batch):
        addrs = seqs[b % len(seqs)].address_list
        base = rng.sample(addrs, min(k, len(addrs)))
        qs = []
        for _ in range(queries):  # overlapping speculative selections, some padding
            q = [a if rng.random() < 0.85 else rng.choice(addrs) for a in base]
            q += [-1] * (k - len(q))
            qs.append(q)
        rows.append(qs)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.fixture(scope="module")
def filled_engine():
    """A filled pool and its adapter for a (policy, prefetch), built once a module: the fill (1,800
    tokens, every layer written) is most of a launch-count case's time, and the launches a prepare
    makes do not depend on what earlier cases left resident."""
    built: dict = {}

    def get(policy, prefetch: bool):
        key = (repr(policy), prefetch)
        if key not in built:
            pool, kv = engine(policy, gpu=1200, cpu=600, max_batch=37, top_k=16, queries=2, prefetch=prefetch)
            built[key] = (pool, kv, fill(pool, kv, requests=6, tokens=300)[0])
        return built[key]

    return get


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("batch", "prefetch", "bound"), [(1, True, 5), (3, True, 5), (37, True, 5), (37, False, 4)]
)
def test_group_step_launches_do_not_grow_with_batch(filled_engine, policy, batch, prefetch, bound) -> None:
    """Per group-step: claim, classify + plan, decide, apply (4); with the prefetch split, apply's
    first layer and the rest are two launches (5); PB-LRU's round end is one more, before decide.
    37 x 2 x 16 = 1184 elements spans two chunks."""
    pool, kv, seqs = filled_engine(policy, prefetch)
    rng = random.Random(batch)
    for group in range(pool.num_groups):
        sel = selection(rng, seqs, batch, 2, 16)
        with count_launches() as names:
            kv.prepare(group, sel)
        split = prefetch and len(pool.group_layers(group)) > 1
        round_end = ["round_end_kernel"] * (str(policy).startswith("PBLRU"))
        assert (
            names
            == ["claim_kernel", "classify_kernel", *round_end, "decide_kernel", "apply_kernel"]
            + ["apply_kernel"] * split
        )
        assert len(names) <= bound + len(round_end)


@skip_under_debug
@pytest.mark.parametrize("policy", POLICIES)
def test_steps_through_the_adapter_never_sync(policy) -> None:
    """Decode steps through the adapter (prepare per group, each layer waits and reads its rows,
    new tokens written) under a patch that fails any host sync; the bytes read are checked after."""
    pool, kv = engine(policy, gpu=44, cpu=60, max_batch=4, top_k=7, queries=3)  # 68 tokens live
    seqs, expected = fill(pool, kv, requests=4, tokens=12)
    rng, gen = random.Random(7), torch.Generator().manual_seed(9)
    # Inputs built before the patch: selections, and the new tokens' addresses and rows.
    plan = []
    for _ in range(5):
        new = [pool.extend(seq, 1) for seq in seqs]  # admission is host bookkeeping (tested apart)
        new_addrs = torch.cat(new)
        writes = [(layer, new_addrs, random_rows(gen, len(seqs), WIDTH)) for layer in range(LAYERS)]
        sels = [selection(rng, seqs, 4, 3, 7) for _ in range(pool.num_groups)]
        plan.append((writes, sels))
        for layer, addrs, rows in writes:
            expected.update({(layer, a): r for a, r in zip(addrs.tolist(), rows, strict=True)})
    read = []
    with no_host_sync():
        for writes, sels in plan:
            for layer, addrs, rows in writes:
                kv.write(layer, addrs, rows)
            for group, sel in enumerate(sels):
                step = kv.prepare(group, sel)
                for layer in step.layers:
                    slots = step.wait(layer)
                    read.append((layer, sel, pool.gpu_buffer(layer)[slots.clamp(min=0).long()].clone()))
    pool.check()
    assert pool.stats()["victims"] > 0  # under pressure: entries left the GPU and came back
    for layer, sel, got in read:
        for a, row in zip(sel.reshape(-1).tolist(), got.reshape(-1, WIDTH), strict=True):
            if a >= 0:
                assert torch.equal(row, expected[(layer, a)])
    pool.check_invariants()


@skip_under_debug
@pytest.mark.parametrize("policy", POLICIES)
def test_a_one_layer_groups_step_is_one_plan(policy) -> None:
    """SGLang's shape, one layer a group: each group-step hands its new tokens' rows to ``prepare``
    (``new=``), one plan instead of a write's and a prepare's: claim, classify + plan, (round end,)
    decide, apply, the new tokens and the selection read in place (no copy: before, both were
    copied into the call scratch first); no host sync, the reserved scratch kept. Every selected
    row reads as written, the new tokens' included."""
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=3,
            layers_per_group=1,
            layout=Tiered(gpu_slots=36, cpu_slots=80, policy=policy),
            validate=False,
        )
    )
    kv = SparseKV(pool, max_batch=4, top_k=6, max_queries=2)
    gen, rng = torch.Generator().manual_seed(4), random.Random(4)
    seqs, expected = [], {}
    for _ in range(4):
        seq = pool.admit(10)
        seqs.append(seq)
        for layer in range(3):
            rows = random_rows(gen, 10, WIDTH)
            pool.write(layer, seq.addresses, rows)
            expected.update({(layer, a): r for a, r in zip(seq.addresses.tolist(), rows, strict=True)})
    scratch = [pool.internals().runner.scratch(1, group) for group in range(3)]
    steps = []
    for _ in range(4):
        new_addrs = torch.cat([pool.extend(seq, 1) for seq in seqs])
        news = [NewRows(layer, new_addrs, random_rows(gen, 4, WIDTH)) for layer in range(3)]
        sels = []
        for _group in range(3):
            sel = selection(rng, seqs, 4, 2, 6)
            sel[:, 0, 0] = new_addrs  # each request attends over its new token
            sels.append(sel)
        steps.append((news, sels))
        for new in news:
            expected.update({(new.layer, a): r for a, r in zip(new_addrs.tolist(), new.rows, strict=True)})
    read = []
    round_end = ["round_end_kernel"] * (str(policy).startswith("PBLRU"))
    with no_host_sync():
        for news, sels in steps:
            for group, (new, sel) in enumerate(zip(news, sels, strict=True)):
                with count_launches() as names, torch_ops() as ops:
                    step = kv.prepare(group, sel, new=new)
                assert not [op for op in ops if "copy" in op], ops
                assert names == [
                    "claim_kernel",
                    "classify_kernel",
                    *round_end,
                    "decide_kernel",
                    "apply_kernel",
                ]
                read.append(
                    (group, sel, pool.gpu_buffer(group)[step.wait(group).clamp(min=0).long()].clone())
                )
    pool.check()
    assert all(pool.internals().runner.scratch(1, group) is scratch[group] for group in range(3))
    assert pool.stats()["victims"] > 0
    for layer, sel, got in read:
        for a, row in zip(sel.reshape(-1).tolist(), got.reshape(-1, WIDTH), strict=True):
            if a >= 0:
                assert torch.equal(row, expected[(layer, a)])
    pool.check_invariants()


def test_steps_use_fixed_buffers() -> None:
    """A step allocates nothing the graph would not own: the slots live in the adapter's buffer
    and the call scratch is the one sized at construction."""
    pool, kv = engine(ExactLRU(), gpu=40, cpu=40, max_batch=5, top_k=6, queries=3)
    seqs, _ = fill(pool, kv, requests=3, tokens=20)
    scratch = [pool.internals().runner.scratch(1, group) for group in range(pool.num_groups)]
    assert all(sc.capacity >= 5 * 3 * 6 for sc in scratch)
    rng = random.Random(1)
    for batch in (5, 2, 4):
        for group in range(pool.num_groups):
            step = kv.prepare(group, selection(rng, seqs, batch, 3, 6))
            assert step.slots.data_ptr() == kv.internals().slots[group].data_ptr()
            assert pool.internals().runner.scratch(1, group) is scratch[group]


def test_a_long_prefill_keeps_the_reserved_scratch() -> None:
    """A write larger than the adapter's bound (a prefill) gets scratch of its own: the scratch a
    captured step points at is never replaced."""
    pool, kv = engine(ExactLRU(), gpu=64, cpu=2100, max_batch=1, top_k=8, validate=True)
    scratch = pool.internals().runner.scratch(1, 0)
    seq = pool.admit(2000)  # > CHUNK elements: needs a scratch twice the reserved one
    rows = random_rows(torch.Generator().manual_seed(2), 2000, WIDTH)
    kv.write(0, seq.addresses, rows)
    assert pool.internals().runner.scratch(1, 0) is scratch
    assert torch.equal(pool.read(0, seq.addresses), rows)
    bad = seq.addresses.clone()
    bad[1500] = 10**6
    with pytest.raises(InvalidAddressError, match=r"\[1000000\]"):  # offenders from the call's scratch
        kv.write(1, bad, rows)


def test_selection_beyond_the_bounds_is_refused() -> None:
    pool, kv = engine(ExactLRU(), gpu=40, cpu=40, max_batch=2, top_k=4, queries=1)
    seq = pool.admit(8)
    with pytest.raises(InvalidInputError, match="exceeds the adapter's bounds"):
        kv.prepare(0, seq.addresses[:5].reshape(1, 5))
    with pytest.raises(InvalidInputError, match="exceeds the adapter's bounds"):
        kv.prepare(0, seq.addresses[:6].reshape(3, 2))
    with pytest.raises(InvalidInputError, match="exceeds the adapter's bounds"):
        kv.prepare(0, seq.addresses[:4].reshape(1, 2, 2))
    with pytest.raises(InvalidInputError, match="max_batch must be a positive int"):
        SparseKV(pool, max_batch=0, top_k=4)
    step = kv.prepare(1, seq.addresses[:4].reshape(1, 4))
    with pytest.raises(InvalidInputError, match="not in group 1"):
        step.wait(0)


def refused_step(kv: SparseKV, seqs, dead, how: str) -> torch.Tensor | None:
    """One refused call through the adapter; returns the step's slots (a prepare)."""
    live = seqs[0].addresses
    if how == "released-address":
        return kv.prepare(0, torch.stack([live[:3], torch.cat([live[3:5], dead[:1]])])).slots
    if how == "too-many-distinct":  # more distinct addresses than the 16 GPU slots
        return kv.prepare(1, torch.cat([a.addresses for a in seqs])[:18].view(2, 9)).slots
    kv.write(4, torch.cat([live[:2], dead[1:2]]), random_rows(9, 3, WIDTH))  # "write-released-address"
    return None


@skip_under_debug  # without validation: ULAKV_DEBUG validates every call
@pytest.mark.parametrize("how", ["released-address", "too-many-distinct", "write-released-address"])
def test_a_refused_step_is_raised_by_the_next_call_without_a_sync(how: str) -> None:
    """With validation off a refused prepare or write returns at once, changes nothing and leaves
    -1 in every slot of its step; the next prepare or write raises its error, naming the kind of call
    refused, and the one after that runs as if nothing had happened. No host sync anywhere (the
    refusing kernel reports to a word of host memory the host reads as it is)."""
    pool, kv = engine(ExactLRU(), gpu=16, cpu=40, max_batch=2, top_k=9, queries=1)
    seqs, expected = fill(pool, kv, requests=3, tokens=7, seed=3)
    gone = pool.admit(4)
    dead = gone.addresses.clone()
    kv.release(gone)
    error = CapacityError if how == "too-many-distinct" else InvalidAddressError
    before = pool.state_dict()
    ok = torch.stack([seqs[1].addresses[:4], seqs[2].addresses[:4]])
    with no_host_sync():
        slots = refused_step(kv, seqs, dead, how)
        call = "write" if how.startswith("write") else "prepare"
        with pytest.raises(error, match=rf"an earlier {call} (of|to) layer group \d \(refused"):
            kv.prepare(0, ok)
    if slots is not None:
        assert (slots == -1).all(), "a refused step's slots must never name a row"
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    with no_host_sync():
        step = kv.prepare(0, ok)  # raised once: the pool goes on
    for layer in pool.group_layers(0):
        got = pool.gpu_buffer(layer)[step.wait(layer).view(-1).long()]
        want = torch.stack([expected[(layer, a)] for a in ok.view(-1).tolist()])
        assert torch.equal(got, want)
    pool.check()  # nothing left behind


@skip_under_debug
def test_a_refusal_is_raised_once_by_check_or_by_the_next_call() -> None:
    pool, kv = engine(PBLRU(4), gpu=16, cpu=40, max_batch=2, top_k=9, queries=1)
    seqs, _ = fill(pool, kv, requests=2, tokens=7, seed=4)
    gone = pool.admit(2)
    dead = gone.addresses.clone()
    kv.release(gone)
    refused_step(kv, seqs, dead, "released-address")
    with pytest.raises(InvalidAddressError):
        pool.check()  # synchronous: raises it now ...
    kv.prepare(0, seqs[0].addresses[:4].view(1, 4))  # ... and the next call does not again
    pool.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_captured_step_replays_correctly() -> None:
    """A group-step (both streams) captured in a CUDA graph replays to the same slots and bytes as
    the eager step it was captured from."""
    pool = Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=656),
            num_layers=4,
            layers_per_group=4,
            layout=Tiered(gpu_slots=256, cpu_slots=1024, policy=PBLRU(8)),
            device="cuda",
        )
    )
    kv = SparseKV(pool, max_batch=4, top_k=64)
    gen = torch.Generator().manual_seed(0)
    seqs = [pool.admit(300) for _ in range(4)]
    for seq in seqs:
        for layer in range(4):
            kv.write(layer, seq.addresses, random_rows(gen, 300, 656).cuda())
    sel = torch.stack([s.addresses[torch.randperm(300, generator=gen)[:64].cuda()] for s in seqs])
    kv.prepare(0, sel)  # warm up: compile every kernel outside the capture
    kv.join()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step = kv.prepare(0, sel)
        kv.join()
    for _ in range(3):
        sel.copy_(torch.stack([s.addresses[torch.randperm(300, generator=gen)[:64].cuda()] for s in seqs]))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(4):
            got = pool.gpu_buffer(layer)[step.slots.long()].cpu()
            want = pool.read(layer, sel.reshape(-1)).reshape(got.shape)
            assert torch.equal(got, want)
    pool.check_invariants()
