"""The DCP store driven as SGLang's scheduler and DSA backend would drive it under ``--dcp-size``,
through SGLang's own index transforms (the pinned wheel's ``transform_index.py``), on gloo ranks.

SGLang's side: ``req_to_token`` maps request positions to ``loc`` (0: padding slot), an allocator
hands ``loc`` out of order over ``[1, N)``, prefixes are shared, a captured batch carries a padding
request (request slot 0). Per step the new tokens are admitted and written on every rank; per
layer group the indexer's top-k positions become ``loc`` through ``transform_index_page_table_decode``,
and the store localises that page table. Oracle: ``transform_index_page_table_dcp`` over SGLang's
dense DCP pool (``loc`` ``s`` at row ``s // D`` of rank ``s % D``). Every real request's rows read
through the store's block table equal SGLang's, bit for bit and in order, with the same counts.
"""

from __future__ import annotations

import random

import pytest
import torch

from tools.sglang_wheel import load_transform_index, wheel_source
from ulakv import CapacityError
from ulakv.integrations.sglang.dcp_store import DcpStoreConfig, SGLangDcpStore
from ulakv.integrations.sglang.layer_groups import group_starts_from_skips
from ulakv.spawn import run_ranks

BYTES = 16
SKIPS = (False, True, False)  # layer 1 reuses layer 0's top-k: groups (0, 1) and (2,)
K = 7


def _row(loc: int, layer: int, life: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(loc * 1009 + layer * 7919 + life * 104729)
    return torch.randint(0, 256, (BYTES,), dtype=torch.uint8, generator=g)


def _serve(rank: int, world: int, seed: int) -> dict:
    transform = load_transform_index(wheel_source())
    cfg = DcpStoreConfig(
        layers=len(SKIPS),
        bytes_per_token=BYTES,
        device_tokens=20,
        host_to_device_ratio=3,
        dcp_size=world,
        dcp_rank=rank,
        page_size=8,
        group_starts=group_starts_from_skips(SKIPS),
    )
    store = SGLangDcpStore(cfg)
    rng = random.Random(seed)  # the same on every rank: every rank makes the same calls
    free_loc = list(range(cfg.page_size * world, cfg.address_space))  # SGLang's pages from the second
    rng.shuffle(free_loc)
    req_to_token = torch.zeros((6, 96), dtype=torch.int32)
    running: dict[int, list[int]] = {}
    holders: dict[int, int] = {}
    life: dict[int, int] = {}
    dense = torch.zeros((len(SKIPS), -(-cfg.address_space // world), BYTES), dtype=torch.uint8)
    free_slots = [1, 2, 3, 4, 5]
    compared = steps = 0

    def alloc(n: int) -> list[int]:
        locs = [free_loc.pop() for _ in range(n)]
        store.admit(torch.tensor(locs))
        for loc in locs:
            life[loc], holders[loc] = life.get(loc, 0) + 1, 0
        for layer in range(len(SKIPS)):
            rows = torch.stack([_row(loc, layer, life[loc]) for loc in locs])
            store.write(layer, torch.tensor(locs), rows)
            for loc, r in zip(locs, rows, strict=True):
                if loc % world == rank:
                    dense[layer, loc // world] = r
        return locs

    def finish(slot: int) -> None:
        gone = []
        for loc in running.pop(slot):
            holders[loc] -= 1
            if holders[loc] == 0:
                del holders[loc]
                gone.append(loc)
        req_to_token[slot] = 0
        free_slots.append(slot)
        if gone:
            store.release(torch.tensor(gone))
            free_loc.extend(gone)

    for step in range(10):
        if len(running) < 3 and len(free_loc) > 60 and rng.random() < 0.8:
            shared = []
            if running and rng.random() < 0.6:  # a prefix-cache hit: another request's first loc
                other = rng.choice(list(running.values()))
                shared = other[: rng.randint(1, len(other))]
            locs = shared + alloc(rng.randint(5, 23))
            slot = free_slots.pop()
            for loc in locs:
                holders[loc] += 1
            req_to_token[slot, : len(locs)] = torch.tensor(locs, dtype=torch.int32)
            running[slot] = locs
        reqs = list(running)
        if not reqs:  # nothing decodes this step
            continue
        for slot, loc in zip(reqs, alloc(len(reqs)), strict=True):  # a decode step's new tokens
            holders[loc] += 1
            req_to_token[slot, len(running[slot])] = loc
            running[slot].append(loc)
        metadata = object()
        # The captured batch: the real requests, then a padding request (slot 0: loc 0 everywhere).
        batch = torch.tensor([*reqs, 0], dtype=torch.int64)
        for layer in range(len(SKIPS)):
            if not SKIPS[layer]:
                topk = torch.full((len(batch), K), -1, dtype=torch.int32)
                for i, slot in enumerate(reqs):
                    picks = rng.sample(range(len(running[slot])), min(K, len(running[slot])))
                    topk[i, : len(picks)] = torch.tensor(picks, dtype=torch.int32)
                topk[-1] = torch.tensor([rng.randrange(3) for _ in range(K)], dtype=torch.int32)
            # A fresh page table every layer, as SGLang's backend makes it; a reusing layer passes
            # the previous layer's top-k tensor, SGLang's reuse key.
            page_table = transform.transform_index_page_table_decode(req_to_token[batch], topk)
            block, counts = store.localize(layer, page_table, metadata=metadata, topk_indices=topk)
            want_block, want_counts = transform.transform_index_page_table_dcp(page_table, world, rank)
            kv = store.kv_rows(layer).view(-1, BYTES)
            assert int(counts[-1]) == 0 and bool((block[-1] == -1).all()), "a padding request reads nothing"
            assert torch.equal(counts[:-1], want_counts[:-1])
            for i in range(len(reqs)):
                n = int(counts[i])
                assert torch.equal(kv[block[i, :n].long()], dense[layer, want_block[i, :n].long()]), (
                    step,
                    layer,
                )
                compared += n
        steps += 1
        if rng.random() < 0.35 or len(running[reqs[0]]) > 40:
            finish(rng.choice(reqs))
        store.pool.check_invariants()
    stats = store.pool.stats()
    live = stats["live_addresses"]
    for slot in list(running):
        finish(slot)
    store.pool.check_invariants()
    return dict(
        compared=compared,
        prepares=store.localizer.prepares,
        steps=steps,
        live=live,
        after=store.pool.stats()["live_addresses"],
        victims=stats["victims"],
        misses=stats["misses"],
    )


@pytest.mark.parametrize("world, seed", [(2, 7)], ids=["dcp2"])
def test_a_dcp_store_serves_sglangs_page_tables(world, seed) -> None:
    found = run_ranks(_serve, world, seed)
    for got in found:
        assert got["compared"] > 0
        assert got["prepares"] == 2 * got["steps"], (
            "a group prepared once a step, its second layer reusing it"
        )
        assert got["after"] == 0
    assert found[0]["live"] == found[1]["live"] > 0  # every rank counts every live loc
    assert sum(g["victims"] for g in found) > 0 and sum(g["misses"] for g in found) > 0


def test_sizes_follow_sglangs_flags() -> None:
    cfg = DcpStoreConfig(
        layers=61, bytes_per_token=656, device_tokens=1000, host_to_device_ratio=4, dcp_size=8, dcp_rank=3
    )
    pool = cfg.pool_config()
    # SGLang's loc space under DCP, (size + page) x D, with size x ratio for size
    assert cfg.logical_tokens == 32_000 and pool.engine_addresses == (4000 + 64) * 8
    inner = pool.layout.inner
    assert inner.gpu_slots == 1000 and inner.capacity == 4064  # the rank's share
    assert pool.page_size == 64 and pool.layout.local


def test_a_prefill_chunk_too_large_for_a_ranks_cache_is_refused_now() -> None:
    """Prefill is not captured: its refusal is raised by the call itself (a non-validating pool,
    as on a GPU), naming the limit, and nothing changes: the next chunk is served."""
    cfg = DcpStoreConfig(
        layers=1,
        bytes_per_token=BYTES,
        device_tokens=8,
        host_to_device_ratio=4,
        dcp_size=2,
        dcp_rank=0,
        page_size=8,
        validate=False,
    )
    store = SGLangDcpStore(cfg)
    loc = torch.arange(1, 41)
    store.admit(loc)
    store.write(0, loc, torch.zeros((40, BYTES), dtype=torch.uint8))
    too_many = loc.view(2, 20).to(torch.int32)  # 20 loc homed on rank 0, its cache holds 8
    with pytest.raises(CapacityError):
        store.prefill_localize(0, too_many)
    block, counts = store.prefill_localize(0, loc[:12].view(3, 4).to(torch.int32))
    assert counts.tolist() == [2, 2, 2] and bool((block[:, 2:] == -1).all())
    store.pool.check_invariants()
