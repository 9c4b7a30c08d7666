"""Decode context parallelism over an exclusive CPU tier, against SGLang's own DCP localisation.

Oracle: SGLang 0.5.23's ``transform_index_page_table_dcp`` (loaded by path from the pinned wheel) on a
dense sharded pool, token slot ``s`` at row ``s // dcp`` of rank ``s % dcp``. ulakv: each rank's
``Striped(attention="local")`` pool over the same slots (engine-owned addresses), a GPU far smaller
than the rank's history and a CPU tier for the rest, localised by ``DcpLocalizer``. On every rank
and layer, the rows attention reads through ulakv's block table equal, bit for bit and in the same
order, the rows it reads through SGLang's, with the same counts, while the pools evict and swap.
"""

from __future__ import annotations

import math

import pytest
import torch

import ulakv
from tools.sglang_wheel import load_transform_index, wheel_source
from ulakv import PBLRU, EntrySpec, ExactLRU, PoolConfig, Striped, Tiered
from ulakv.errors import ConfigError, InvalidAddressError, InvalidInputError
from ulakv.integrations.sglang.dcp import DcpLocalizer, sglang_dcp_reference
from ulakv.spawn import run_ranks

WIDTH = 20  # bytes a row: odd rows of 5 words
LAYERS, PER_GROUP = 4, 2  # two groups of two layers sharing a top-k
N = 211  # the engine's token slots: not a multiple of any world
TOPK = 11
GPU_SLOTS = 34  # per rank: 3 requests x 11 picks fit, the rank's history does not


def _config(
    world: int, rank: int, policy, cpu_slots: int | None = None, validate: bool | None = None, page: int = 1
) -> PoolConfig:
    share = math.ceil(N / world)
    return PoolConfig(
        validate=validate,
        page_size=page,
        entry=EntrySpec(bytes_per_layer=WIDTH),
        num_layers=LAYERS,
        layers_per_group=PER_GROUP,
        engine_addresses=N,
        layout=Striped(
            world=world,
            rank=rank,
            attention="local",
            inner=Tiered(gpu_slots=GPU_SLOTS, cpu_slots=cpu_slots or share, policy=policy),
        ),
    )


def _traffic(seed: int):
    """Three requests of odd lengths; the first two share a 17-token prefix (the same slots, as
    SGLang's radix cache shares them). Returns each request's slots at each of 6 decode steps, and
    every slot's bytes for every layer."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(N, generator=gen).tolist()  # the engine's allocator hands slots out of order
    take = iter(order)
    prefix = [next(take) for _ in range(17)]
    prompts = [prefix + [next(take) for _ in range(n)] for n in (23, 40)] + [[next(take) for _ in range(51)]]
    steps = [[next(take) for _ in prompts] for _ in range(6)]
    kv = torch.randint(0, 256, (LAYERS, N, WIDTH), dtype=torch.uint8, generator=gen)
    return prompts, steps, kv


def _page_table(requests: list[list[int]], gen: torch.Generator) -> torch.Tensor:
    """A decode step's page table: each request's top-k positions as slots, -1 past a short row,
    and a CUDA-graph padding row of -1 only."""
    table = torch.full((len(requests) + 1, TOPK), -1, dtype=torch.int32)
    for i, slots in enumerate(requests):
        k = min(TOPK, len(slots) - i)  # rows of several lengths
        picks = torch.randperm(len(slots), generator=gen)[:k]
        picks[0] = len(slots) - 1  # the newest token, as the window does
        table[i, :k] = torch.tensor([slots[p] for p in picks.tolist()], dtype=torch.int32)
    return table


def _dcp_against_sglang(rank: int, world: int, policy_name: str, seed: int, page: int) -> dict:
    transform = load_transform_index(wheel_source()).transform_index_page_table_dcp
    policy = ExactLRU() if policy_name == "lru" else PBLRU(4)
    pool = ulakv.Pool(_config(world, rank, policy, page=page))
    localizer = DcpLocalizer(pool)
    if page > 1:  # the block table indexes the paged view as SGLang's DCP attention reads it
        assert pool.paged_buffer(0).shape == (1, page, 1, WIDTH)
        assert pool.paged_buffer(0).data_ptr() == pool.gpu_buffer(0).data_ptr()
    prompts, steps, kv = _traffic(seed)
    dense = torch.zeros((LAYERS, math.ceil(N / world), WIDTH), dtype=torch.uint8)  # SGLang's rank pool

    def admit_and_write(slots: list[int]) -> None:
        addrs = torch.tensor(slots, dtype=torch.int64)
        pool.admit_addresses(addrs)
        for layer in range(LAYERS):
            pool.write(layer, addrs, kv[layer, addrs])
            mine = addrs[addrs % world == rank]
            dense[layer, mine // world] = kv[layer, mine]

    admit_and_write(list(dict.fromkeys(prompts[0] + prompts[1] + prompts[2])))  # the prefix once
    requests = [list(p) for p in prompts]
    gen = torch.Generator().manual_seed(seed + 1)
    rows_compared = 0
    for step, new in enumerate(steps):
        admit_and_write(new)
        for slots, token in zip(requests, new, strict=True):
            slots.append(token)
        metadata = object()  # SGLang's forward metadata: one object a step, every group
        table = _page_table(requests, gen)
        for group in range(LAYERS // PER_GROUP):
            if step % 2 == 0 or group == 0:  # odd steps: both groups select through one tensor
                table = _page_table(requests, gen)
            for layer in range(group * PER_GROUP, (group + 1) * PER_GROUP):
                block, counts = localizer.localize(layer, table, step=metadata)
                want_block, want_counts = transform(table, world, rank)
                assert block.dtype == torch.int32 and counts.dtype == torch.int32
                assert block.shape == table.shape and counts.shape == (table.shape[0],)
                assert torch.equal(counts, want_counts)
                for i in range(table.shape[0]):
                    n = int(counts[i])
                    assert bool((block[i, n:] == -1).all()) and bool((block[i, :n] >= 0).all())
                    rows = pool.paged_buffer(layer).view(-1, WIDTH) if page > 1 else pool.gpu_buffer(layer)
                    ours = rows[block[i, :n].long()]
                    theirs = dense[layer, want_block[i, :n].long()]
                    assert torch.equal(ours, theirs), (step, layer, i)
                    rows_compared += n
        pool.check_invariants()
    pool.release_addresses(torch.tensor(sorted({s for r in requests for s in r}), dtype=torch.int64))
    pool.check_invariants()
    stats = pool.stats()
    return dict(
        rows=rows_compared,
        prepares=localizer.prepares,
        misses=stats["misses"],
        victims=stats["victims"],
        bytes_in=stats["bytes_in"],
        live=stats["live_addresses"],
    )


@pytest.mark.parametrize(
    "world, policy, seed, page",
    [
        pytest.param(2, "lru", 3, 1, id="world2-exact_lru"),
        pytest.param(4, "pblru", 5, 64, id="world4-pblru4-pages64"),
    ],
)
def test_localised_rows_equal_sglang_dcp_on_a_dense_sharded_pool(world, policy, seed, page) -> None:
    found = run_ranks(_dcp_against_sglang, world, policy, seed, page)
    for rank, got in enumerate(found):
        assert got["rows"] > 0, rank
        assert got["prepares"] == 6 * (LAYERS // PER_GROUP), "a group's second layer prepared again"
        assert got["live"] == 0
    # The pools did evict to their CPU tiers and swap back: the GPU holds 34 rows of a rank's
    # 100+ (world 2) or 50+ (world 4).
    assert sum(g["victims"] for g in found) > 0
    assert sum(g["bytes_in"] for g in found) > 0


def _refusals(rank: int, world: int) -> list[str]:
    pool = ulakv.Pool(_config(world, rank, ExactLRU()))
    localizer = DcpLocalizer(pool)
    pool.admit_addresses(torch.tensor([0, 1, 2, 3, 4, 5]))
    calls = [  # 6..9 were never admitted, N is out of range, 5 is live already
        lambda: localizer.localize(0, torch.tensor([[6, 7]], dtype=torch.int32)),
        lambda: localizer.localize(0, torch.tensor([[0, 9]], dtype=torch.int32)),
        lambda: pool.admit_addresses(torch.tensor([5, 5])),
        lambda: localizer.localize(0, torch.tensor([[N]], dtype=torch.int32)),
    ]
    said = []
    for call in calls:
        try:
            call()
        except (InvalidAddressError, InvalidInputError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    pool.check_invariants()
    assert pool.stats()["live_addresses"] == 6
    return said


def test_a_bad_slot_is_refused_on_every_rank_alike() -> None:
    """Every rank decides from the same books: a rank that homes none of the bad slots refuses too."""
    found = run_ranks(_refusals, 2)
    assert found[0] == found[1] and len(found[0]) == 4


def test_a_rank_too_small_for_its_share_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="share of the engine's addresses"):
        _config(2, 0, ExactLRU(), cpu_slots=math.ceil(N / 2) - GPU_SLOTS - 1)
    with pytest.raises(ConfigError, match='attention="fetch"'):
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=1,
            engine_addresses=N,
            layout=Striped(world=2, rank=0, buffer_slots=8),
        )


def _deferred(rank: int, world: int) -> tuple[str, int, list[int]]:
    """Without validation (a GPU's default), a refused admit changes nothing and is raised by the
    next call on every rank; a localisation into the caller's fixed buffers (a captured step) writes
    them in place."""
    pool = ulakv.Pool(_config(world, rank, ExactLRU(), validate=False))
    localizer = DcpLocalizer(pool)
    pool.admit_addresses(torch.arange(8))
    pool.write(0, torch.arange(8), torch.full((8, WIDTH), 7, dtype=torch.uint8))
    pool.admit_addresses(torch.tensor([3, 9]))  # 3 is live: refused, 9 not admitted either
    table = torch.tensor([[1, 2, 3, -1], [4, 5, 6, 7]], dtype=torch.int32)
    with pytest.raises(InvalidAddressError, match="admit_addresses"):
        localizer.localize(0, table)
    out = torch.full((2, 4), -7, dtype=torch.int32)
    counts = torch.full((2,), -7, dtype=torch.int32)
    block, found = localizer.localize(0, table, out=out, counts=counts)
    assert block.data_ptr() == out.data_ptr() and found.data_ptr() == counts.data_ptr()
    pool.check_invariants()
    return str(pool.stats()["live_addresses"]), int(found.sum()), block.flatten().tolist()


def test_a_deferred_refusal_and_fixed_buffers() -> None:
    found = run_ranks(_deferred, 2)
    assert [f[0] for f in found] == ["8", "8"]  # 9 was not admitted
    assert sum(f[1] for f in found) == 7  # every valid slot on exactly one rank


def _refilled(rank: int, world: int) -> list[list[int]]:
    """A page table refilled in place for the next step, with the same metadata object (a static
    buffer of a captured step): the next step prepares again from the group's first layer."""
    pool = ulakv.Pool(_config(world, rank, ExactLRU()))
    localizer = DcpLocalizer(pool)
    pool.admit_addresses(torch.arange(16))
    for layer in range(LAYERS):
        pool.write(layer, torch.arange(16), torch.arange(16 * WIDTH, dtype=torch.uint8).view(16, WIDTH))
    table = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    metadata = object()
    seen = []
    for fill in ([0, 1, 2, 3], [8, 9, 10, 11]):
        table.copy_(torch.tensor([fill], dtype=torch.int32))
        for layer in range(PER_GROUP):
            block, counts = localizer.localize(layer, table, step=metadata)
            rows = pool.gpu_buffer(layer)[block[0, : int(counts[0])].long()]
            seen.append(rows[:, 0].tolist())
    assert localizer.prepares == 2
    return seen


def test_a_page_table_refilled_in_place_is_prepared_again() -> None:
    for rank, seen in enumerate(run_ranks(_refilled, 2)):
        mine = [[a * WIDTH % 256 for a in fill if a % 2 == rank] for fill in ([0, 1, 2, 3], [8, 9, 10, 11])]
        assert seen == [mine[0], mine[0], mine[1], mine[1]]


def test_the_ranks_of_a_dcp_group_need_no_process_group() -> None:
    """Local mode never communicates outside ``read``: an engine whose DCP group is a subgroup of
    its world (SGLang: --dcp-size dividing --tp-size) builds a rank's pool with no process group of
    that size. Here all 3 ranks of a group live in one process and still serve SGLang's rows."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    world = 3
    transform = load_transform_index(wheel_source()).transform_index_page_table_dcp
    _, _, kv = _traffic(9)
    addrs = torch.arange(1, 60)
    table = torch.tensor([[5, 17, 2, 40, -1], [33, 34, 35, 1, 59]], dtype=torch.int32)
    counted = 0
    for rank in range(world):
        pool = ulakv.Pool(_config(world, rank, ExactLRU()))
        pool.admit_addresses(addrs)
        for layer in range(LAYERS):
            pool.write(layer, addrs, kv[layer, addrs])
        block, counts = DcpLocalizer(pool).localize(0, table)
        want_block, want_counts = transform(table, world, rank)
        assert torch.equal(counts, want_counts)
        for i in range(table.shape[0]):
            n = int(counts[i])
            mine = want_block[i, :n].long() * world + rank  # back to the global slots
            assert torch.equal(pool.gpu_buffer(0)[block[i, :n].long()], kv[0, mine])
            counted += n
        with pytest.raises(ulakv.UlakvError, match=r"torch\.distributed"):
            pool.read(0, addrs[:2])
    assert counted == int((table >= 0).sum())


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_torch_reference_equals_sglangs_kernel(world) -> None:
    transform = load_transform_index(wheel_source()).transform_index_page_table_dcp
    gen = torch.Generator().manual_seed(world)
    table = torch.randint(-1, 500, (9, 37), dtype=torch.int32, generator=gen)
    table[3] = -1  # a padding row
    for rank in range(world):
        want = transform(table, world, rank)
        got = sglang_dcp_reference(table, world, rank)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_groups_moves_on_the_side_stream_split_first_layer_first() -> None:
    """With a ``SparseKV`` the localisation's moves run as the engine adapter runs them: on CPU
    ``prefetch=True`` splits a two-layer group's moves (the first layer's rows, then the rest) as a
    GPU's side stream does. Over a decode loop that evicts to the CPU tier, every table, count and
    row read equals the unsplit pool's, and only the split's launches are added."""
    from ulakv.engine import SparseKV

    world, rank = 2, 1
    prompts, steps, kv = _traffic(4)
    pools = [ulakv.Pool(_config(world, rank, ExactLRU())) for _ in range(2)]
    split = SparseKV(pools[1], max_batch=4, top_k=TOPK, prefetch=True)
    localizers = [DcpLocalizer(pools[0]), DcpLocalizer(pools[1], kv=split)]
    gen = torch.Generator().manual_seed(4)
    live = sorted({s for p in prompts for s in p})
    for pool in pools:
        pool.admit_addresses(torch.tensor(live))
        for layer in range(LAYERS):
            pool.write(layer, torch.tensor(live), kv[layer, live])
    requests = [list(p) for p in prompts]
    for new in steps:
        for request, slot in zip(requests, new, strict=True):
            request.append(slot)
        for pool in pools:
            pool.admit_addresses(torch.tensor(new))
        for layer in range(LAYERS):
            pools[0].write(layer, torch.tensor(new), kv[layer, new])
            split.write(layer, torch.tensor(new), kv[layer, new])
        table, metadata = _page_table(requests, gen), object()
        for layer in range(LAYERS):
            got = [loc.localize(layer, table, step=metadata) for loc in localizers]
            assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
            rows = [
                pool.gpu_buffer(layer)[block.clamp(min=0).long()]
                for pool, (block, _) in zip(pools, got, strict=True)
            ]
            assert torch.equal(rows[0], rows[1])
    assert localizers[0].prepares == localizers[1].prepares == len(steps) * (LAYERS // PER_GROUP)
    stats = [pool.stats() for pool in pools]
    assert stats[0]["misses"] > 0 and stats[0]["victims"] > 0  # the CPU tier served some rows
    for key in ("bytes_in", "bytes_out", "misses", "victims"):
        assert stats[0][key] == stats[1][key], key
    assert stats[1]["launches"] > stats[0]["launches"]  # the first layer's moves ran on their own
