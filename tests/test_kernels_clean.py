"""The kernels against their references under traffic that evicts clean (an entry swapped in from a
CPU row leaves that row holding its bytes; evicted while that copy is intact, it goes back there and
no bytes move): every call's stages equal their references, state and scratch, with copies made by
swap-ins alone and by writes too, across chunks, and where the LRU lists fall short."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import RowModel, addr_tensor, assert_reads, fill, random_rows, release_against_reference
from test_kernels import run_stagewise
from tier_helpers import POLICIES, copies, deltas, split, tiered

from ulakv import PBLRU, ExactLRU
from ulakv.kernels import common as K

KERNEL_CASES = [
    # id, gpu_slots, cpu_slots, staging, bytes, layers, per group, policy
    ("lru-short-group-12B", 5, 8, None, 12, 3, 2, ExactLRU()),
    ("pblru3-short-group-12B", 5, 8, None, 12, 3, 2, PBLRU(3)),
    ("lru-tight-5B", 4, 3, 2, 5, 3, 2, ExactLRU()),
    ("pblru3-tight-5B", 4, 3, 2, 5, 3, 2, PBLRU(3)),
]


@pytest.mark.parametrize("write_copies", [False, True], ids=["swap-in-copies", "write-copies"])
@pytest.mark.parametrize(
    ("gpu", "cpu", "staging", "width", "layers", "per_group", "policy"),
    [c[1:] for c in KERNEL_CASES],
    ids=[c[0] for c in KERNEL_CASES],
)
def test_stages_match_reference_with_clean_evictions(
    gpu, cpu, staging, width, layers, per_group, policy, write_copies
) -> None:
    """Admissions, rewrites (on either tier; with write copies, through to an intact copy),
    prepares (some applied in the engine's split) and releases; each call's stages equal their
    references, state and scratch, and the state at rest (copies' bytes included) passes the
    structural check."""
    pool = tiered(
        policy,
        gpu=gpu,
        cpu=cpu,
        width=width,
        layers=layers,
        per_group=per_group,
        staging=staging,
        write_copies=write_copies,
    )
    most = pool.config.layout.max_selection
    rng, gen = random.Random(3), torch.Generator().manual_seed(width)
    seqs, rewrote_copies = [], 0
    for _ in range(24):
        op = rng.choices(["admit", "release", "rewrite", "prepare"], [2, 1, 2, 5])[0]
        live = [a for s in seqs for a in s.address_list]
        if (op == "admit" or len(live) < gpu + 2) and pool.free_addresses:
            seq = pool.admit(rng.randint(1, min(3, pool.free_addresses)))
            seqs.append(seq)
            for layer in range(layers):
                addrs = seq.addresses
                run_stagewise(
                    pool, pool.config.group_of(layer), addrs, random_rows(gen, addrs.numel(), width), layer
                )
        elif op == "release" and len(seqs) > 1:
            seq = seqs.pop(rng.randrange(len(seqs)))
            release_against_reference(pool, seq)
        elif op == "rewrite":  # of an entry with a copy where there is one: ends it, or writes through
            with_copies = [x for x in range(layers) if copies(pool, pool.config.group_of(x))]
            layer = rng.choice(with_copies or list(range(layers)))
            held = list(copies(pool, pool.config.group_of(layer)))
            first = rng.choice(held or live)
            addrs = torch.tensor([first, *rng.sample([x for x in live if x != first], 1)])
            rewrote_copies += bool(held)
            run_stagewise(
                pool, pool.config.group_of(layer), addrs, random_rows(gen, addrs.numel(), width), layer
            )
        else:
            group = rng.randrange(pool.num_groups)
            picks = rng.sample(live, min(len(live), most))
            sel = torch.tensor([rng.choice([*picks, -1]) for _ in range(most + 1)])
            run_stagewise(pool, group, sel, split=rng.random() < 0.5)
        pool.check_invariants()
    stats = pool.stats()
    assert stats["clean_evictions"] > 0
    assert stats["victims"] > stats["clean_evictions"]
    assert rewrote_copies > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_clean_and_dirty_victims_across_chunks_match_reference(policy) -> None:
    """A prepare of more than one CHUNK whose victims are dirty (written on the GPU: no copy),
    clean and popping nothing (copies deeper than the call can pop), or clean after popping a row
    (copies deeper than the rows it actually pops) at once: the number of clean victims before each
    one crosses chunk boundaries, so pops and pushes are placed by a prefix across programs. Every
    stage equals its reference."""
    pool = tiered(policy, gpu=1500, cpu=1700, width=4, layers=1, per_group=1)
    model = RowModel(4)
    addrs = pool.admit(3000).addresses.tolist()
    fill(pool, model, addrs, seed=4)
    run_stagewise(pool, 0, addr_tensor(split(pool, 0, addrs)[1][:1200]))  # 1,200 copies, 500 plain rows
    later = split(pool, 0, addrs)[1][:1100]
    sel = addr_tensor(later + later[:200])  # 1,300 elements, duplicates across the chunk boundary
    s0 = pool.stats()
    run_stagewise(pool, 0, sel)  # evicts the 300 entries written on the GPU, then 800 swapped in
    d = deltas(s0, pool.stats())
    assert d["victims"] == 1100 and 0 < d["clean_evictions"] <= 800, d
    assert d["bytes_out"] == (1100 - d["clean_evictions"]) * 4
    assert_reads(pool, model, addrs)
    pool.check_invariants()


def test_lru_lists_that_fall_short_carry_clean_victims_like_the_others() -> None:
    """Stale pairs crowd the LRU ring's head, so the classify programs' lists hold fewer candidates
    than the call evicts and the planning program lists more segments itself; the victims found
    there are clean or not exactly as in a classify program's list. Every stage equals its
    reference."""
    pool = tiered(ExactLRU(), gpu=1500, cpu=2000, width=4, layers=1, per_group=1)
    model = RowModel(4)
    addrs = pool.admit(3000).addresses.tolist()
    fill(pool, model, addrs, seed=5)
    run_stagewise(pool, 0, addr_tensor(split(pool, 0, addrs)[1][:1000]))  # 1,000 in, with copies
    run_stagewise(pool, 0, addr_tensor(split(pool, 0, addrs)[0][:500]))  # the 500 left re-touched
    # The ring from its head: 500 stale pairs, the 1,000 swapped in, the 500 re-touched. A
    # one-chunk prepare of 600 misses lists 1,024 positions (524 candidates) and must list more.
    run_stagewise(pool, 0, addr_tensor(split(pool, 0, addrs)[1][:600]))
    assert int(pool.internals().state.ctl[int(K.E_SEG_BLOCKS)]) > 1, "the lists did not fall short"
    d = pool.stats()
    assert d["clean_evictions"] == 600, d  # all 600 victims were swapped in, their copies deep
    assert_reads(pool, model, addrs)
    pool.check_invariants()
