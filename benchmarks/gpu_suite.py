"""The GPU suite: one command, correctness first, then every GPU figure the project claims.

    python benchmarks/gpu_suite.py [--out gpu_suite.json]     # one H200: under 8 minutes
    python benchmarks/gpu_suite.py --smoke [--out smoke.json]   # tiny sizes; CPU: Triton interpreter

Sections, in order (a failed check stops the suite before any timing):

1. ``correctness``: every kernel on this device against its plain reference (``*_reference``) on
   the same inputs: a pool running the Triton kernels and a pool running the references go through
   the same admits, writes, prepares (whole and split the way the engine runs them) and releases;
   their state must stay bit-identical; then gather and release on the final state. Then the same at
   real shapes (``correctness_at_scale``): 8 x CHUNK elements a selection, 64 K GPU slots (four
   bitmap levels), both policies, calls enough for the LRU ring to compact, against the
   references run on a CPU copy.
2. ``ceilings``: device-to-device copy and pinned host-to-device copy, GB/s (bytes copied / time).
3. ``gather``: the selected rows of a step (656-byte rows, top-k 2048, batch 1..256) read by the
   gather kernel from GPU slots, against the copy ceiling; and from pinned CPU rows (zero-copy
   through unified addressing), against the host-to-device ceiling.
4. ``swap_in``: a ``prepare`` whose selection is all on the CPU with the GPU full: rows in (and
   victims out) per second, against the host-to-device ceiling.
5. ``prepare``: time per group-step, exact LRU and PB-LRU(8), batch 1, 8, 64, 256 x 3 query
   positions x top-k 2048 (beside the time its misses take at the host-to-device ceiling), a
   1 M-slot GPU pool, selections from ``ulakv.traces.synthetic``; ``fits`` (nothing must be evicted)
   and ``evicting`` (the GPU is full of other requests' entries).
6. ``graph``: one engine step (``SparseKV``, 4-layer group, side stream) captured in a CUDA graph and
   replayed; replay time against the eager step; the replayed slots hold the right bytes.
7. ``striped_graph``: a striped rank's ``prepare`` in both attention modes (a process group of one
   rank: NCCL on the device, gloo on CPU), fetch mode with its all-gather, captured in a CUDA graph
   and replayed on fresh selections; the replayed slots hold the right bytes. ``dcp``: SGLang's
   decode context parallelism over ulakv, the 4 ranks of a group in one process (``SGLangDcpStore``
   each, a GPU cache of half a step's share), every rank's rows read through its block table
   against SGLang's DCP transform (its torch twin) over a dense sharded pool, then one rank's
   localisation captured in a CUDA graph and replayed on fresh page tables.
8. ``requests``: what a request costs outside ``prepare``, on the stream decode runs on: an
   engine-owned pool of 61 one-layer groups (DSA under SGLang: an indexer per layer), a decode
   step's admission of 256 new tokens, a 16K-token prompt's admission, and its release once its
   rows are written (the GPU full, the rest on the CPU); both policies.
9. ``compiled``: every variant the device compiled over the sections above (the serving mix),
   with its registers, spill bytes and the warps an SM keeps resident.
10. ``vector_widths``: gather and swap-in with rows moved in 16-byte vectors against 4-byte words,
   alternating in one process (the time ratio is the figure).
11. ``soak`` (``gpu_serving.py``): 10,000 decode steps of a 1 M-slot group at batch 64 and 256,
   both policies, each step a write of the new tokens and a prepare of a DSA-shaped top-2048
   (``SparseKV``): median, p99 and worst step on the GPU, hits and evictions a step, and the
   per-kernel table (launches a step, microseconds a launch) over 50 profiled steps.
12. ``whole_step`` (``gpu_serving.py``): one decode step of 61 one-layer groups (every write and
   prepare, on the call contexts' streams; then every group's one plan, ``prepare(..., new=)``)
   captured in one CUDA graph and replayed on new tokens and fresh selections; its launches, eager
   time against replay time, both ways; the slots hold their bytes.
13. ``refusals``: a step of 8 groups makes no device-to-host copy (the profiler); a refused
   prepare is raised by the next call. ``overlap``: two groups' plans and moves on their call
   contexts' streams, as an event timeline, beside one stream.

Sections are selectable (``--only prepare requests``); ``--keep-going`` records a failed section and
runs the rest (one lease on new hardware, every failure seen).

Prints a table per section and writes everything to ``--out`` as JSON. Timings on CPU (smoke) are the
interpreter's and mean nothing; the smoke run exists so that this script cannot rot (CI runs it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gpu_serving
import torch
from gpu_harness import Skip, in_suite_order, run_section, section_names

from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Striped, Tiered
from ulakv.engine import SparseKV
from ulakv.integrations.sglang.dcp import sglang_dcp_reference
from ulakv.integrations.sglang.dcp_store import DcpStoreConfig, SGLangDcpStore
from ulakv.kernels import common as K
from ulakv.kernels import gather as gather_mod
from ulakv.kernels import release as release_mod
from ulakv.kernels._triton import count_launches
from ulakv.kernels.buckets import level_offsets
from ulakv.kernels.operands import as_words
from ulakv.layouts.tiered_state import REFERENCE
from ulakv.traces import SyntheticSpec, synthetic
from ulakv.transfer import Phase

ROW = 656  # GLM-5 / DeepSeek-V3.2 FP8 latent bytes a token-layer


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    gpu_slots: int
    topk: int
    batches: tuple[int, ...]
    context: int  # tokens of history per decoding request (evicting case)
    steps: int  # timed steps per point (after one warm-up)
    graph_slots: int
    graph_batch: int

    scale_slots: int  # GPU slots of the real-shape correctness pools
    scale_elements: int  # elements of each of their selections
    scale_calls: int
    request_groups: int  # one-layer groups of the requests section's pool
    request_tokens: int  # tokens of its prompt
    # Random calls of the small correctness section, each policy. The smoke run (CPU CI, where
    # test_kernels.py and the policy tests hold every kernel to its reference) only keeps the
    # section from rotting: 16 calls there admit, write, release, prepare, split and evict.
    correctness_calls: int = 40


FULL = Sizes(1 << 30, 1 << 20, 2048, (1, 8, 64, 256), 16384, 5, 1 << 16, 8, 1 << 16, 8 * 1024, 32, 61, 16384)
SMOKE = Sizes(1 << 20, 2048, 16, (1, 4), 64, 1, 512, 2, 2048, 2 * 1024, 6, 3, 96, correctness_calls=16)


# -- timing -----------------------------------------------------------------------------------------
def timed(fn: Callable[[int], object], reps: int, device: torch.device, warmup: int = 1) -> float:
    """Median seconds of ``fn(i)`` over ``reps`` runs (CUDA events on a GPU)."""
    for i in range(warmup):
        fn(-1 - i)
    times = []
    for i in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernel_us(fn: Callable[[int], object], reps: int, device: torch.device) -> dict[str, float]:
    """Device microseconds a call of ``fn(i)`` spends in each kernel (the profiler's CUDA
    activity), by kernel name: beside a wall-clock time, what is GPU work and what is host time."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(i)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us:
            out[event.key] = out.get(event.key, 0.0) + us / reps
    return out


def timed_after(
    setup: Callable[[], object], call: Callable[[], object], reps: int, device: torch.device
) -> float:
    """Median seconds of ``call()`` over ``reps`` runs (after one warm-up), each after an untimed
    ``setup()``."""
    times = []
    for rep in range(reps + 1):
        setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            call()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            call()
            seconds = time.perf_counter() - t
        if rep:
            times.append(seconds)
    return statistics.median(times)


def table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    if not rows:
        return
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def make_pool(device, gpu, cpu, policy, *, layers=1, per_group=1, validate=False) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=ROW),
            num_layers=layers,
            layers_per_group=per_group,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=policy),
            device=device,
            validate=validate,
        )
    )


def write_all(pool: Pool, addrs: torch.Tensor, layers: range, chunk: int = 1 << 16) -> None:
    for start in range(0, addrs.numel(), chunk):
        part = addrs[start : start + chunk]
        for layer in layers:
            rows = ((part[:, None] * 131 + layer * 29 + torch.arange(ROW, device=part.device)) % 251).to(
                torch.uint8
            )
            pool.write(layer, part, rows)


# -- 1. correctness ---------------------------------------------------------------------------------
def same_state(a: Pool, b: Pool) -> str | None:
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:
        x, y = sa[key].cpu(), sb[key].cpu()
        if key == "gpu_data":  # the dummy row absorbs padding writes in any order
            x, y = x[:, :-1], y[:, :-1]
        if not torch.equal(x, y):
            return key
    return None


def correctness(device: torch.device, calls: int, seed: int = 0) -> list[dict]:
    rows = []
    for policy in (ExactLRU(), PBLRU(3)):
        kernels, refs = (make_pool(device, 24, 40, policy, layers=3, per_group=2) for _ in range(2))
        refs.internals().runner.kernels = REFERENCE
        rng = random.Random(seed)
        seqs: list[tuple] = []  # (sequence in kernels, sequence in refs): the same addresses
        for call in range(calls):
            op = rng.random()
            live = [a for s, _ in seqs for a in s.address_list]
            if (op < 0.3 or not live) and kernels.free_addresses >= 8:
                n = rng.randint(1, 8)
                pair = (kernels.admit(n), refs.admit(n))
                seqs.append(pair)
                gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
                for layer in range(3):
                    data = torch.randint(0, 256, (n, ROW), dtype=torch.uint8, generator=gen).to(device)
                    for pool, seq in zip((kernels, refs), pair, strict=True):
                        pool.write(layer, seq.addresses, data)
            elif op < 0.4 and seqs:
                pair = seqs.pop(rng.randrange(len(seqs)))
                for pool, seq in zip((kernels, refs), pair, strict=True):
                    pool.release(seq)
            elif live:
                group = rng.randrange(2)
                cand = rng.sample(live, min(len(live), 10))
                picks = [[[rng.choice([*cand, -1]) for _ in range(5)] for _ in range(2)] for _ in range(2)]
                sel = torch.tensor(picks, device=device)
                split = group == 0 and rng.random() < 0.5  # group 0 has 2 layers: the engine's split
                for pool in (kernels, refs):
                    plan = pool.plan(group, sel)
                    if split:
                        pool.run(plan, until=Phase.IN, in_layers=range(0, 1))
                    pool.run(plan)
            bad = same_state(kernels, refs)
            if bad is not None:
                raise AssertionError(f"{policy}: kernels and references differ in {bad!r} after call {call}")
        st = kernels.internals().state
        live = torch.tensor([a for s, _ in seqs for a in s.address_list], dtype=torch.int64, device=device)
        for layer in range(3):
            g = layer // 2
            gpu, cpu = as_words(st.gpu_data[layer]), as_words(st.cpu_data[layer])
            args = (live, st.mapping[g], st.gpu_slots, gpu, cpu)
            # The plain-Python reference builds its rows on the CPU.
            if not torch.equal(gather_mod.gather(*args).cpu(), gather_mod.gather_reference(*args)):
                raise AssertionError(f"{policy}: gather differs from its reference in layer {layer}")
        ref = st.clone()
        release_mod.release(live, st)
        release_mod.release_reference(live, ref)
        for key, value in st.tensors().items():
            if key != "gpu_data" and not torch.equal(value, ref.tensors()[key]):
                raise AssertionError(f"{policy}: release differs from its reference in {key}")
        rows.append({"policy": str(policy), "calls": calls, "result": "bit-identical"})
    return rows


def correctness_at_scale(device: torch.device, sizes: Sizes, seed: int = 1) -> list[dict]:
    """The same comparison at real shapes: selections of ``scale_elements`` (8 x CHUNK in the full
    run: many classify and apply programs, candidate lists over many segments) on pools of
    ``scale_slots`` GPU slots (64 K: four bitmap levels), long enough for the LRU ring to compact
    and for evictions both clean (back to an intact CPU copy) and copying.
    The references run on a CPU copy of the pool (a plain-Python reference on the device would read
    every word back one at a time)."""
    G, T = sizes.scale_slots, sizes.scale_elements
    cpu = torch.device("cpu")
    rows = []
    for policy in (ExactLRU(), PBLRU(8)):
        kernels = make_pool(device, G, 2 * G, policy, layers=2, per_group=2)
        refs = make_pool(cpu, G, 2 * G, policy, layers=2, per_group=2)
        pinned = kernels.internals().runner.state.cpu_data.is_pinned()  # mapped, then registered with CUDA
        if device.type == "cuda" and not pinned:
            raise AssertionError(f"{policy}: the CPU tier is not page-locked for the GPU")
        refs.internals().runner.kernels = REFERENCE
        n = 3 * G - T  # nearly full: misses evict once the GPU tier is full
        kernels.admit(n)
        seq_ref = refs.admit(n)  # the same addresses in both (fresh allocators)
        gen = torch.Generator().manual_seed(seed)
        # Some entries carry data (each with a write copy in a plain CPU row), the rest read as zeros
        # and get no copy until evicted once: evictions both clean and copying.
        written = seq_ref.addresses[: min(2 * T, n // 2)]
        for layer in range(2):
            data = torch.randint(0, 256, (written.numel(), ROW), dtype=torch.uint8, generator=gen)
            kernels.write(layer, written.to(device), data.to(device))
            refs.write(layer, written, data)
        # Two phases, 5/8 and 3/8 of the calls. The first picks a quarter of each selection again
        # every call and the rest at random: many misses, the GPU fills and evicts both written
        # entries (copying) and entries swapped in from their CPU rows (clean; at 64 K slots that
        # took 20 calls, 12 were not enough). The second picks three quarters again: hits leave stale
        # ring pairs faster than victims retire them, so the exact LRU ring compacts (a quarter alone
        # never compacted it at 64 K slots: the head's advance kept the ring's span under 2 G).
        order = torch.randperm(n, generator=gen)
        compactions, seg_blocks = 0, 0
        for call in range(sizes.scale_calls):
            hot = order[: (T // 4 if call < sizes.scale_calls * 5 // 8 else 3 * T // 4)]
            fresh = torch.randint(0, n, (T - hot.numel(),), generator=gen)
            picks = torch.cat([hot, fresh])[torch.randperm(T, generator=gen)]
            sel = seq_ref.addresses[picks].view(-1, 1024 if T % 1024 == 0 else T).to(torch.int32)
            for pool, where in ((kernels, device), (refs, cpu)):
                plan = pool.plan(0, sel.to(where))
                if pool is kernels:  # the ring blocks the plan compacts (0: none)
                    compactions += int(kernels.internals().state.ctl[int(K.E_RING_BLOCKS)]) > 0
                    seg_blocks = max(seg_blocks, int(kernels.internals().state.ctl[int(K.E_SEG_BLOCKS)]))
                pool.run(plan, until=Phase.IN, in_layers=range(0, 1))  # the engine's split
                pool.run(plan)
            bad = same_state(kernels, refs)
            if bad is not None:
                raise AssertionError(f"{policy}: kernels and references differ in {bad!r} after call {call}")
            # Every block of candidate segments was sealed by its last lister, who reset its count
            # (the acquire-release handshake between classify programs that only a GPU races).
            if kernels.internals().runner.scratch(T).seg_arrivals.any():
                raise AssertionError(
                    f"{policy}: a segment block's arrival count left non-zero after call {call}"
                )
        stats = kernels.stats()
        if stats["clean_evictions"] == 0 or stats["clean_evictions"] == stats["victims"]:
            raise AssertionError(f"{policy}: evictions were not both clean and copying: tested too little")
        if isinstance(policy, ExactLRU) and compactions == 0:
            raise AssertionError(f"{policy}: no ring compaction: the section tested too little")
        kernels.check_invariants()  # every CPU copy a clean eviction trusts equals its slot's bytes
        rows.append(
            {
                "policy": str(policy),
                "gpu_slots": G,
                "elements": T,
                "calls": sizes.scale_calls,
                "victims": stats["victims"],
                "clean_evictions": stats["clean_evictions"],
                "ring_compactions": compactions,
                "segment_blocks_summed": seg_blocks,
                "bitmap_levels": len(level_offsets(G)) - 1,
                "result": "bit-identical",
            }
        )
    return rows


# -- 2. ceilings ------------------------------------------------------------------------------------
def ceilings(device: torch.device, sizes: Sizes) -> dict[str, float]:
    n = sizes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    d2d = n / timed(lambda i: dst.copy_(src), 5, device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    h2d = n / timed(lambda i: dst.copy_(host, non_blocking=True), 5, device)
    return {"d2d_GBps": d2d / 1e9, "pinned_h2d_GBps": h2d / 1e9}


# -- 3. gather, 4. swap-in ------------------------------------------------------------------------
def gather_rows(device: torch.device, sizes: Sizes, ceil: dict[str, float]) -> list[dict]:
    G, K = sizes.gpu_slots, sizes.topk
    pool = make_pool(device, G, G, ExactLRU())
    seq = pool.admit(2 * G)
    write_all(pool, seq.addresses, range(1))  # the first G rows on the GPU, the rest on the CPU
    st = pool.internals().state
    gpu_words, cpu_words = as_words(st.gpu_data[0]), as_words(st.cpu_data[0])
    home = st.mapping[0]
    on_gpu = seq.addresses[home[seq.addresses] < G]
    on_cpu = seq.addresses[home[seq.addresses] >= G]
    out = []
    gen = torch.Generator().manual_seed(1)
    for tier, pool_of, ceiling in (
        ("gpu", on_gpu, ceil["d2d_GBps"]),
        ("cpu", on_cpu, ceil["pinned_h2d_GBps"]),
    ):
        for B in sizes.batches:
            n = min(B * K, pool_of.numel())
            addrs = pool_of[torch.randperm(pool_of.numel(), generator=gen)[:n].to(device)]
            secs = timed(
                lambda i, a=addrs: gather_mod.gather(a, home, G, gpu_words, cpu_words), sizes.steps, device
            )
            gbps = n * ROW / secs / 1e9
            out.append(
                {
                    "tier": tier,
                    "batch": B,
                    "rows": n,
                    "us": secs * 1e6,
                    "GBps": gbps,
                    "of_ceiling": gbps / ceiling,
                }
            )
    return out


def swap_in(device: torch.device, sizes: Sizes, ceil: dict[str, float]) -> list[dict]:
    """GPU full, every selected entry on the CPU: each prepare swaps B x K rows in and out."""
    G, K = sizes.gpu_slots, sizes.topk
    out = []
    for B in sizes.batches:
        n = min(B * K, G)
        pool = make_pool(device, G, G + (sizes.steps + 1) * n, ExactLRU())
        seq = pool.admit(G + (sizes.steps + 1) * n)
        write_all(pool, seq.addresses, range(1))
        cold = seq.addresses[G:]  # written after the GPU filled up: on the CPU
        # Each run selects n entries nobody selected before (the warm-up takes the last slice).
        slices = [cold[j * n : (j + 1) * n].view(1, n) for j in range(sizes.steps + 1)]
        secs = timed(lambda i, p=pool, s=slices: p.prepare(0, s[i % len(s)]), sizes.steps, device)
        victims = pool.stats()["victims"] / (sizes.steps + 1)  # warm-up included
        gbps = n * ROW / secs / 1e9
        out.append(
            {
                "batch": B,
                "rows_in": n,
                "us": secs * 1e6,
                "in_GBps": gbps,
                "of_h2d_ceiling": gbps / ceil["pinned_h2d_GBps"],
                "victims_per_prepare": victims,
            }
        )
        del pool
    return out


def vector_widths(device: torch.device, sizes: Sizes, ceil: dict[str, float]) -> list[dict]:
    """Rows moved in 16-byte vectors against single 4-byte words, side by side in one process:
    gather from each tier and swap-in at the two largest batches, alternating the width
    (``ulakv.kernels.rows.VECTOR_BYTES``) so that drift of the machine hits both alike."""
    from ulakv.kernels import rows as rows_mod

    # The interpreter's timings mean nothing: one round at the largest batch only
    cuda = device.type == "cuda"
    big = Sizes(**{**sizes.__dict__, "batches": sizes.batches[-2:] if cuda else sizes.batches[-1:]})
    runs: dict[int, dict[str, list[dict]]] = {16: {}, 4: {}}
    rounds = 2 if cuda else 1
    for _ in range(rounds):
        for width in (16, 4):
            saved, rows_mod.VECTOR_BYTES = rows_mod.VECTOR_BYTES, width
            try:
                for name, fn in (("gather", gather_rows), ("swap_in", swap_in)):
                    runs[width].setdefault(name, []).extend(fn(device, big, ceil))
            finally:
                rows_mod.VECTOR_BYTES = saved
    out = []
    for name in ("gather", "swap_in"):
        for wide, narrow in zip(runs[16][name], runs[4][name], strict=True):
            case = f"gather {wide['tier']}" if name == "gather" else "swap-in"
            out.append(
                {
                    "case": case,
                    "batch": wide["batch"],
                    "us_16B": wide["us"],
                    "us_4B": narrow["us"],
                    "16B_over_4B": wide["us"] / narrow["us"],
                }
            )
    return out


# -- 5. prepare per group-step ----------------------------------------------------------------------
def prepare_steps(device: torch.device, sizes: Sizes, ceil: dict[str, float]) -> list[dict]:
    """Time a group-step's ``prepare`` at batch x 3 query positions x top-k, next to the time its
    misses' rows take at the measured pinned host-to-device ceiling (what the step cannot beat)."""
    G, K, steps = sizes.gpu_slots, sizes.topk, sizes.steps + 1
    profiled = 3  # selections after the timed ones, for the profiler's per-kernel device time
    Bmax = max(sizes.batches)
    out = []
    for case in ("fits", "evicting"):
        context = min(sizes.context, G // Bmax) if case == "fits" else sizes.context
        filler = 0 if case == "fits" else G
        trace = synthetic(
            SyntheticSpec(
                requests=Bmax, prompt=(context - steps - profiled,) * 2, steps=steps + profiled, topk=K,
                queries=3, groups=1, window=min(128, K // 4), heavy=min(512, K // 4), arrival_spread=0,
                seed=3,
            )
        )  # fmt: skip
        for policy in (ExactLRU(), PBLRU(8)):
            history = Bmax * context + filler
            pool = make_pool(device, G, max(0, history - G), policy)
            if filler:
                write_all(pool, pool.admit(filler).addresses, range(1))
            seqs = [pool.admit(context) for _ in range(Bmax)]
            write_all(pool, torch.cat([s.addresses for s in seqs]), range(1))
            # Selections as addresses, on the device, before any timing.
            picks = []
            for s in range(steps + profiled):
                rows = []
                for b, r in enumerate(trace.requests):
                    pos = r.topk[s, 0].to(device).long()  # [3, K]
                    rows.append(torch.where(pos >= 0, seqs[b].addresses[pos.clamp(min=0)], -1))
                picks.append(torch.stack(rows))
            for B in sizes.batches:
                before = pool.stats()
                with count_launches() as names:
                    # The warm-up (i = -1) takes step 0's selection, the timed runs the steps after it.
                    batch = [p[:B] for p in picks]
                    secs = timed(lambda i, p=pool, b=batch: p.prepare(0, b[i + 1]), steps - 1, device)
                after = pool.stats()
                calls = steps
                per_kernel = kernel_us(
                    lambda i, p=pool, b=batch: p.prepare(0, b[steps + i]), profiled, device
                )
                misses = (after["misses"] - before["misses"]) / calls
                out.append(
                    {
                        "case": case,
                        "policy": str(policy),
                        "batch": B,
                        "us_per_group_step": secs * 1e6,
                        "launches": len(names) // calls,
                        "hit_rate": (after["hits"] - before["hits"])
                        / max(1, after["hits"] - before["hits"] + after["misses"] - before["misses"]),
                        "victims_per_step": (after["victims"] - before["victims"]) / calls,
                        # Exact LRU: ring pairs compaction scanned; PB-LRU: words its round ends merged.
                        "upkeep_reads_per_step": (after["round_upkeep_reads"] - before["round_upkeep_reads"])
                        / calls,
                        "misses_per_step": misses,
                        "us_misses_at_h2d_ceiling": misses * ROW / (ceil["pinned_h2d_GBps"] * 1e9) * 1e6,
                        # Device time of the call's kernels (the rest of the wall-clock time is host work)
                        # and the longest kernel, from the profiler on the same selections.
                        "gpu_us": sum(per_kernel.values()),
                        "longest_kernel": max(per_kernel, key=per_kernel.get, default="-"),
                        "longest_us": max(per_kernel.values(), default=0.0),
                    }
                )
            del pool
    return out


# -- 6. CUDA graph ----------------------------------------------------------------------------------
def graph_step(device: torch.device, sizes: Sizes) -> dict:
    G, K, B, layers = sizes.graph_slots, sizes.topk, sizes.graph_batch, 4
    pool = make_pool(device, G, 4 * G, PBLRU(8), layers=layers, per_group=layers)
    kv = SparseKV(pool, max_batch=B, top_k=K, prefetch=True)
    seqs = [pool.admit(4 * G // B) for _ in range(B)]
    write_all(pool, torch.cat([s.addresses for s in seqs]), range(layers))
    gen = torch.Generator().manual_seed(5)

    def fresh_selection() -> torch.Tensor:
        return torch.stack([s.addresses[torch.randperm(len(s), generator=gen)[:K].to(device)] for s in seqs])

    sel = fresh_selection()
    sels = [fresh_selection() for _ in range(2 * sizes.steps + 4)]  # fresh picks each run: misses too

    def eager_step(i: int) -> None:
        sel.copy_(sels[i])
        kv.prepare(0, sel)
        kv.join()

    eager = timed(eager_step, sizes.steps, device)
    result = {"batch": B, "topk": K, "layers": layers, "eager_us": eager * 1e6}
    if device.type != "cuda":
        result["captured"] = "skipped: needs CUDA"
        return result
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step = kv.prepare(0, sel)
        kv.join()
    checked = 0
    for _ in range(3):
        sel.copy_(fresh_selection())
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            got = pool.gpu_buffer(layer)[step.slots.long()].cpu()
            want = pool.read(layer, sel.reshape(-1)).reshape(got.shape).cpu()
            if not torch.equal(got, want):
                raise AssertionError(f"graph replay: layer {layer} slots do not hold their bytes")
            checked += got.shape[0] * got.shape[1]
    replay = timed(lambda i: (sel.copy_(sels[sizes.steps + 2 + i]), graph.replay()), sizes.steps, device)
    pool.check_invariants()
    result.update(captured="replayed correctly", rows_checked=checked, replay_us=replay * 1e6)
    return result


def group_overlap(device: torch.device, sizes: Sizes) -> dict:
    """Two one-layer groups prepared back to back, each on its call context's stream (as
    ``SparseKV`` runs them), every prepare with misses: the timeline of each group's plan and
    moves (event times in ms after a common start) shows group 1 planning while group 0's rows
    still come in; beside it the same two prepares on one stream."""
    G, K, B = sizes.graph_slots, sizes.topk, sizes.graph_batch
    pool = make_pool(device, G, 4 * G, ExactLRU(), layers=2, per_group=1)
    seqs = [pool.admit(4 * G // B) for _ in range(B)]
    write_all(pool, torch.cat([s.addresses for s in seqs]), range(2))
    gen = torch.Generator().manual_seed(6)

    def fresh_selection() -> torch.Tensor:
        return torch.stack([s.addresses[torch.randperm(len(s), generator=gen)[:K].to(device)] for s in seqs])

    if pool.call_contexts != 2:
        raise AssertionError(f"two groups, {pool.call_contexts} call contexts")
    result: dict = {"batch": B, "topk": K, "gpu_slots": G}
    if device.type != "cuda":
        for g in range(2):  # the calls themselves still run, one after the other
            pool.prepare(g, fresh_selection())
        result["timeline"] = "skipped: needs CUDA"
        return result
    current = torch.cuda.current_stream(device)
    streams = [torch.cuda.Stream(device) for _ in range(2)]

    def two_groups(on: list) -> tuple[torch.cuda.Event, list[list[torch.cuda.Event]]]:
        sels = [fresh_selection() for _ in range(2)]
        start = torch.cuda.Event(enable_timing=True)
        start.record(current)
        marks = []
        for g, stream in enumerate(on):
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                events[0].record()
                plan = pool.plan(g, sels[g])
                events[1].record()
                pool.run(plan)
                events[2].record()
            marks.append(events)
        for stream in on:
            current.wait_stream(stream)
        torch.cuda.synchronize(device)
        return start, marks

    two_groups(streams)  # warm: compiled, scratch sized
    for name, on in (("contexts", streams), ("one_stream", [current, current])):
        start, marks = two_groups(on)
        at = [[start.elapsed_time(e) for e in events] for events in marks]
        result[f"{name}_g0_plan_ms"] = f"{at[0][0]:.3f}-{at[0][1]:.3f}"
        result[f"{name}_g0_moves_end_ms"] = round(at[0][2], 3)
        result[f"{name}_g1_plan_ms"] = f"{at[1][0]:.3f}-{at[1][1]:.3f}"
        result[f"{name}_g1_moves_end_ms"] = round(at[1][2], 3)
        result[f"{name}_overlap_ms"] = round(max(0.0, at[0][2] - at[1][0]), 3)
        result[f"{name}_total_ms"] = round(max(at[0][2], at[1][2]), 3)
    pool.check()
    return result


# -- 7. a striped rank's prepare in a CUDA graph ---------------------------------------------------
def striped_graph(device: torch.device, sizes: Sizes) -> list[dict]:
    """Both attention modes on a group of one rank (one GPU here): every entry is homed on it, so
    fetch mode's buffer fetches its own rows through a real all-gather of a fixed width. Nothing in
    ``prepare`` reads the device, so the step is captured as is."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return [_striped_step(device, sizes, attention) for attention in ("fetch", "local")]
    finally:
        dist.destroy_process_group()


def _striped_step(device: torch.device, sizes: Sizes, attention: str) -> dict:
    G, K, B = sizes.graph_slots, sizes.topk, sizes.graph_batch
    buffer = {"buffer_slots": B * K} if attention == "fetch" else {}
    inner = Tiered(gpu_slots=B * K, cpu_slots=4 * G)
    layout = Striped(world=1, rank=0, attention=attention, inner=inner, **buffer)
    entry = EntrySpec(bytes_per_layer=ROW)
    config = PoolConfig(entry, num_layers=2, layers_per_group=2, layout=layout, device=device, validate=False)
    pool = Pool(config)
    seqs = [pool.admit(4 * G // B) for _ in range(B)]
    write_all(pool, torch.cat([s.addresses for s in seqs]), range(2))
    gen = torch.Generator().manual_seed(7)

    def fresh_selection() -> torch.Tensor:
        return torch.stack([s.addresses[torch.randperm(len(s), generator=gen)[:K].to(device)] for s in seqs])

    sel = fresh_selection()
    eager = timed(lambda i: (sel.copy_(fresh_selection()), pool.prepare(0, sel)), sizes.steps, device)
    row = {"attention": attention, "batch": B, "topk": K, "eager_us": eager * 1e6}
    if device.type != "cuda":
        return {**row, "captured": "skipped: needs CUDA"}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        slots = pool.prepare(0, sel).slots
    checked = 0
    for _ in range(3):
        sel.copy_(fresh_selection())
        graph.replay()
        torch.cuda.synchronize()
        pool.check()  # a refusal recorded by a replay raises here
        for layer in range(2):
            got = pool.gpu_buffer(layer)[slots.long()].cpu()
            want = pool.read(layer, sel.reshape(-1)).reshape(got.shape).cpu()
            if not torch.equal(got, want):
                raise AssertionError(f"striped {attention} graph replay: layer {layer} slots are wrong")
            checked += got.shape[0] * got.shape[1]
    replay = timed(lambda i: (sel.copy_(fresh_selection()), graph.replay()), sizes.steps, device)
    pool.check_invariants()
    return {**row, "captured": "replayed correctly", "rows_checked": checked, "replay_us": replay * 1e6}


# -- SGLang's decode context parallelism over ulakv ----------------------------------------------------
DCP_RANKS = 4


def dcp_localize(device: torch.device, sizes: Sizes) -> list[dict]:
    """SGLang's DCP over ulakv on one GPU: the ``DCP_RANKS`` ranks of a group in one process (a
    local-mode rank needs no process group), each an ``SGLangDcpStore`` whose GPU cache holds half
    a step's selection of its share; every step the same page table (``loc`` of random top-k
    picks, a padding request of loc 0) localised on every rank, its rows read through the block
    table against SGLang's transform over a dense sharded pool, then one rank's localisation
    captured in a CUDA graph and replayed on fresh page tables."""
    D, B, K = DCP_RANKS, sizes.graph_batch, sizes.topk
    tokens = max(sizes.context, 4 * K)
    gpu = max(B * K // 2, 8)
    ratio = -(-(B * tokens + 1) // (D * gpu)) + 1
    stores = [
        SGLangDcpStore(
            DcpStoreConfig(
                layers=1,
                bytes_per_token=ROW,
                device_tokens=gpu,
                host_to_device_ratio=ratio,
                dcp_size=D,
                dcp_rank=r,
                device=device,
                validate=False,
            )
        )
        for r in range(D)
    ]
    gen = torch.Generator().manual_seed(11)
    loc = (torch.randperm(stores[0].config.address_space - 1, generator=gen)[: B * tokens] + 1).view(
        B, tokens
    )
    rows = torch.randint(0, 256, (B * tokens, ROW), dtype=torch.uint8, generator=gen)
    dense = []
    for r, store in enumerate(stores):
        flat = loc.reshape(-1).to(device)
        store.admit(flat)
        store.write(0, flat, rows.to(device))
        mine = loc.reshape(-1) % D == r
        table = torch.zeros((-(-store.config.address_space // D), ROW), dtype=torch.uint8)
        table[loc.reshape(-1)[mine] // D] = rows[mine]
        dense.append(table.to(device))

    def page_table() -> torch.Tensor:
        picks = torch.stack([torch.randperm(tokens, generator=gen)[:K] for _ in range(B)])
        table = torch.gather(loc, 1, picks)
        table[:, -1] = -1  # a short row
        return torch.cat([table, torch.zeros((1, K), dtype=table.dtype)]).to(torch.int32).to(device)

    checked = 0
    for _ in range(max(sizes.steps, 2)):
        pt = page_table()
        for r, store in enumerate(stores):
            block, counts = store.localize(0, pt)
            want_block, want_counts = sglang_dcp_reference(pt[:-1], D, r)
            if int(counts[-1]) != 0 or not torch.equal(counts[:-1], want_counts):
                raise AssertionError(f"rank {r}: counts differ from SGLang's")
            kv = store.kv_rows(0).view(-1, ROW)
            valid = want_block >= 0
            if not torch.equal(kv[block[:-1][valid].long()], dense[r][want_block[valid].long()]):
                raise AssertionError(f"rank {r}: rows read through the block table differ from SGLang's")
            checked += int(valid.sum())
    moved = {k: sum(st.pool.stats()[k] for st in stores) for k in ("misses", "victims")}
    row = {"ranks": D, "batch": B, "topk": K, "gpu_slots_a_rank": gpu, "rows_checked": checked, **moved}
    if device.type != "cuda":
        return [{**row, "captured": "skipped: needs CUDA"}]
    store = stores[1]
    pt = page_table()
    out = torch.empty_like(pt)
    counts = torch.empty(pt.shape[0], dtype=torch.int32, device=device)
    store.localize(0, pt, out=out, counts=counts)  # warm-up: compiles, sizes the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.localize(0, pt, out=out, counts=counts)
    for _ in range(3):
        pt.copy_(page_table())
        graph.replay()
        torch.cuda.synchronize()
        store.pool.check()
        want_block, want_counts = sglang_dcp_reference(pt[:-1], D, 1)
        valid = want_block >= 0
        kv = store.kv_rows(0).view(-1, ROW)
        if not torch.equal(counts[:-1], want_counts) or not torch.equal(
            kv[out[:-1][valid].long()], dense[1][want_block[valid].long()]
        ):
            raise AssertionError("a replayed localisation differs from SGLang's")
    replay = timed(lambda i: (pt.copy_(page_table()), graph.replay()), sizes.steps, device)
    eager = timed(lambda i: store.localize(0, pt), sizes.steps, device)
    return [{**row, "captured": "replayed correctly", "eager_us": eager * 1e6, "replay_us": replay * 1e6}]


# -- 8. a request's admission and release --------------------------------------------------------------
def request_calls(device: torch.device, sizes: Sizes) -> list[dict]:
    """An engine-owned pool's calls outside ``prepare``: each runs between decode steps on their
    stream, so its time is a stall of the next step (``benchmarks/release_path.py`` counts the
    memory operations of their busiest programs)."""
    groups, T = sizes.request_groups, sizes.request_tokens
    step_tokens = min(max(sizes.batches), T)
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randperm(2 * T, generator=gen)[:T].to(device)
    step = prompt[:step_tokens]
    out = []
    for name, policy in (("exact LRU", ExactLRU()), ("PB-LRU(8)", PBLRU(8))):
        pool = Pool(
            PoolConfig(
                entry=EntrySpec(bytes_per_layer=ROW),
                num_layers=groups,
                layers_per_group=1,
                layout=Tiered(gpu_slots=T // 2, cpu_slots=T, policy=policy),
                device=device,
                validate=False,
                engine_addresses=2 * T,
            )
        )
        live = []

        def give_back(pool=pool, live=live) -> None:
            while live:
                pool.release_addresses(live.pop())

        def admitted_and_written(pool=pool, live=live) -> None:
            give_back()
            pool.admit_addresses(prompt)
            live.append(prompt)
            write_all(pool, prompt, range(groups))

        reps = sizes.steps
        admit_step = timed_after(
            give_back, lambda p=pool, ls=live: (p.admit_addresses(step), ls.append(step)), reps, device
        )
        admit_prompt = timed_after(
            give_back, lambda p=pool, ls=live: (p.admit_addresses(prompt), ls.append(prompt)), reps, device
        )
        release_prompt = timed_after(
            admitted_and_written, lambda p=pool, ls=live: p.release_addresses(ls.pop()), reps, device
        )
        pool.check()  # a deferred refusal would surface here
        live_after = pool.stats()["live_addresses"]
        if live_after:
            raise AssertionError(f"requests ({name}): {live_after} addresses still live after every release")
        for call, tokens, secs in (
            ("admit_addresses (decode step)", step_tokens, admit_step),
            ("admit_addresses (prompt)", T, admit_prompt),
            ("release_addresses (prompt, written)", T, release_prompt),
        ):
            out.append({"policy": name, "groups": groups, "call": call, "tokens": tokens, "us": secs * 1e6})
        del pool
    return out


# -- 9. what the device compiled -------------------------------------------------------------------
def refusal_reports(device: torch.device) -> dict:
    """A step of 8 one-layer groups (a write and a prepare each) makes no device-to-host copy: a
    refusal reaches the host as the word the refusing kernel stores in mapped host memory. Then a
    refused prepare is raised by the next call, naming it, once its kernel has run."""
    groups = 8
    pool = make_pool(device, 64, 128, ExactLRU(), layers=groups, per_group=1)
    seq = pool.admit(48)
    write_all(pool, seq.addresses, range(groups))
    new = seq.addresses[:4]
    rows = torch.zeros((4, ROW), dtype=torch.uint8, device=device)
    pick = seq.addresses[8:24].view(1, 16)

    def step() -> None:
        for g in range(groups):
            pool.write(g, new, rows)
            pool.prepare(g, pick)

    step()  # warm: compiled, scratch sized
    copies = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize(device)
        copies = sum(1 for e in prof.events() if "DtoH" in e.name or "Device -> " in e.name)
        if copies:
            raise AssertionError(f"a step of {groups} groups copied {copies} times to the host")
    pool.prepare(0, torch.tensor([[int(seq.addresses[0]), 10_000]], device=device))  # not live
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the report has landed: the next call must see it
    try:
        pool.prepare(0, pick)
    except Exception as exc:  # the refusal, named
        if "an earlier prepare" not in str(exc):
            raise AssertionError(f"the refusal was raised in other words: {exc}") from exc
    else:
        raise AssertionError("a refused prepare was not raised by the next call")
    pool.check()
    return {"groups": groups, "step_copies_to_host": copies, "refusal": "raised by the next call"}


def compiled_variants(device: torch.device) -> list[dict]:
    """Every variant of every ulakv kernel this process compiled, as the device's loader reports
    it: registers a thread, spill bytes, warps, shared memory, and the warps an SM keeps resident
    (64 at most on sm_90: the latency a memory-bound kernel can hide). Read after every other
    section ran, so the variant count is the suite's whole serving mix."""
    import importlib
    import pkgutil

    import ulakv.kernels
    from ulakv.kernels._triton import triton
    from ulakv.kernels.compile_check import resident_warps

    if device.type != "cuda":
        return []
    rows = []
    for info in pkgutil.iter_modules(ulakv.kernels.__path__):
        module = importlib.import_module(f"ulakv.kernels.{info.name}")
        for name, fn in vars(module).items():
            if not isinstance(fn, triton.runtime.jit.JITFunction) or fn.__module__ != module.__name__:
                continue
            for caches in fn.device_caches.values():
                for kernel in caches[0].values():
                    kernel._init_handles()
                    warps, shared = kernel.metadata.num_warps, kernel.metadata.shared
                    rows.append(
                        {
                            "kernel": f"{info.name}.{name}",
                            "regs": kernel.n_regs,
                            "spills": kernel.n_spills,
                            "warps": warps,
                            "shared": shared,
                            "resident_warps": resident_warps(kernel.n_regs, warps, shared),
                        }
                    )
    return rows


def meta(device: torch.device, smoke: bool) -> dict:
    import triton

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit or "unknown",
        "command": " ".join(["python", *sys.argv]),
        "smoke": smoke,
    }


# Sections measured against the copy ceilings (skipped, and said so, when that section failed).
NEEDS_CEILINGS = {"gather", "swap_in", "prepare", "vector_widths"}


def sections(device: torch.device, sizes: Sizes) -> list[tuple[str, str, Callable[[dict], object]]]:
    """The suite's sections in order: (name, table title, run given the results so far)."""
    serving = gpu_serving.SMOKE if sizes is SMOKE else gpu_serving.FULL
    return [
        (
            "correctness",
            "correctness: kernels against references on this device",
            lambda r: correctness(device, sizes.correctness_calls),
        ),
        (
            "correctness_at_scale",
            "correctness at real shapes: device kernels against references on the CPU",
            lambda r: correctness_at_scale(device, sizes),
        ),
        ("ceilings", "ceilings (GB/s)", lambda r: ceilings(device, sizes)),
        (
            "gather",
            f"gather of selected {ROW}-byte rows, top-k {sizes.topk}",
            lambda r: gather_rows(device, sizes, r["ceilings"]),
        ),
        (
            "swap_in",
            "swap-in from pinned CPU rows (prepare, GPU full)",
            lambda r: swap_in(device, sizes, r["ceilings"]),
        ),
        (
            "prepare",
            f"prepare per group-step, {sizes.gpu_slots} GPU slots, top-k {sizes.topk}",
            lambda r: prepare_steps(device, sizes, r["ceilings"]),
        ),
        ("graph", "one engine step in a CUDA graph", lambda r: graph_step(device, sizes)),
        (
            "soak",
            "decode soak: write + prepare a step, one group, GPU-time per step (ms)",
            lambda r: gpu_serving.soak(device, serving),
        ),
        (
            "whole_step",
            "a whole decode step in one CUDA graph: every group's write and prepare, then one plan each",
            lambda r: gpu_serving.whole_step(device, serving),
        ),
        (
            "overlap",
            "two groups' prepares on their call contexts' streams: the timeline (ms)",
            lambda r: group_overlap(device, sizes),
        ),
        (
            "striped_graph",
            "a striped rank's prepare in a CUDA graph (world 1)",
            lambda r: striped_graph(device, sizes),
        ),
        (
            "dcp",
            f"SGLang's DCP over ulakv: {DCP_RANKS} ranks in one process, against SGLang's transform",
            lambda r: dcp_localize(device, sizes),
        ),
        (
            "requests",
            "a request's admission and release (engine-owned pool)",
            lambda r: request_calls(device, sizes),
        ),
        (
            "refusals",
            "a step's status without a copy to the host; a refusal raised by the next call",
            lambda r: refusal_reports(device),
        ),
        (
            "compiled",
            "compiled variants: registers, spills, resident warps",
            lambda r: compiled_variants(device),
        ),
        (
            "vector_widths",
            "rows in 16-byte vectors against 4-byte words, side by side (time ratio)",
            lambda r: vector_widths(device, sizes, r["ceilings"]),
        ),
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU under the interpreter")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these sections (by name; space- or comma-separated), in suite order",
    )
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="record a failed section's error and run the rest (a first run on new hardware: one lease, "
        "every failure); without it the first failure stops the suite before any timing",
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("the full suite needs a CUDA device; use --smoke on CPU")
    sizes = SMOKE if args.smoke else FULL
    known = sections(device, sizes)
    names = [name for name, _, _ in known]
    only = None
    if args.only is not None:
        try:
            only = [n for text in args.only for n in section_names(names)(text)]
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        if NEEDS_CEILINGS & set(only):  # what gather, swap-in and prepare are measured against
            only.append("ceilings")
    started = time.perf_counter()
    results: dict = {"meta": meta(device, args.smoke), "errors": {}, "sections": []}
    print(json.dumps(results["meta"]), flush=True)
    runs = {name: (title, run) for name, title, run in known}
    for name in in_suite_order(only, names):
        title, run = runs[name]

        def section(details: dict, run=run, name=name) -> object:
            if name in NEEDS_CEILINGS and "ceilings" not in results:
                raise Skip("the ceilings section failed")
            return run(results)

        result, value = run_section(name, section)
        results["sections"].append({k: v for k, v in result.__dict__.items() if k != "details"})
        if result.status != "PASS":
            results["errors"][name] = result.error or f"{result.status}: {result.reason}"
            print(f"\n== {title}: {result.status} after {result.seconds:.1f} s", flush=True)
            print(results["errors"][name], flush=True)
            if result.status == "FAIL" and (not args.keep_going or not _device_usable(device)):
                _write(args.out, results)
                raise SystemExit(f"section {name} failed: {result.reason}")
            continue
        results[name] = value
        table(title, value if isinstance(value, list) else [value])
        print(f"({name}: {result.seconds:.1f} s)", flush=True)
        _write(args.out, results)  # what finished survives a later section's crash or timeout
    results["meta"]["seconds"] = time.perf_counter() - started
    print(f"\ndone in {results['meta']['seconds']:.1f} s")
    _write(args.out, results)
    if results["errors"]:
        raise SystemExit(f"failed sections: {sorted(results['errors'])}")
    return results


def _device_usable(device: torch.device) -> bool:
    """False after a fault that poisons the CUDA context (an illegal or misaligned address is
    sticky: every later section would fail with the same error and bury the first)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except RuntimeError:
        return False
    return True


def _write(out: Path | None, results: dict) -> None:
    if out is not None:
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
