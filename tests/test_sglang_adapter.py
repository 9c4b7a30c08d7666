"""The SGLang adapter on CPU, through SGLang's own index transforms (loaded from the pinned wheel by
path) and the adapter's real coordinator and store.

The test drives them the way SGLang's scheduler and DSA backend do, with SGLang's conventions:
``req_to_token`` (int32 ``[request slots, context]``) maps a request's positions to token slots
``loc``; ``loc`` 0 is SGLang's padding slot and never a token's; the allocator hands ``loc`` out in
no particular order, and a request that hits the prefix cache starts with another request's ``loc``.
Each decode step writes the new tokens' rows, then per layer the indexer's top-k positions (request
local, ``-1`` padding) go through ``swap_in_selected_pages``; every row read through the returned
slots of ``kv_buffer`` must be the row written for that position, byte for byte, while requests come
and go and the GPU cache is far smaller than what is live. Speculative verify sends ``[B, Q, K]``.
A captured batch's padding rows (past ``num_real_reqs``) come back as -1.
"""

from __future__ import annotations

import random

import pytest
import torch

from tools.sglang_wheel import load_transform_index, wheel_source
from ulakv import CapacityError
from ulakv.integrations.sglang import SGLangStore, StoreConfig, UlakvSparseCoordinator
from ulakv.integrations.sglang.layer_groups import group_starts_from_skips

BYTES = 16


@pytest.fixture(scope="module")
def transform():
    """SGLang 0.5.23's ``transform_index.py``, from the wheel fetched by the test set-up."""
    return load_transform_index(wheel_source())


def row(loc: int, layer: int, life: int) -> torch.Tensor:
    """The row a token's KV holds: distinct per slot, layer and the slot's life (a reused slot's old
    row would differ)."""
    g = torch.Generator().manual_seed(loc * 1009 + layer * 7919 + life * 104729)
    return torch.randint(0, 256, (BYTES,), dtype=torch.uint8, generator=g)


class Engine:
    """SGLang's bookkeeping, as its scheduler keeps it: request slots, ``req_to_token``, a ``loc``
    allocator with prefix sharing (reference counts, like the radix cache), and the store it feeds."""

    def __init__(self, store: SGLangStore, slots: int, context: int, seed: int) -> None:
        self.store = store
        self.rng = random.Random(seed)
        self.req_to_token = torch.zeros((slots, context), dtype=torch.int32)
        self.free_req_slots = list(range(1, slots))  # slot 0: padding requests of a captured batch
        space = store.config.logical_tokens
        self.free_loc = list(range(1, space + 1))
        self.rng.shuffle(self.free_loc)
        self.holders: dict[int, int] = {}
        self.life: dict[int, int] = {}
        self.lives = 0
        self.running: dict[int, list[int]] = {}  # request slot -> its loc, by position

    def alloc(self, n: int) -> list[int]:
        locs = [self.free_loc.pop() for _ in range(n)]
        self.store.admit(torch.tensor(locs, dtype=torch.int64))
        for loc in locs:
            self.lives += 1
            self.life[loc], self.holders[loc] = self.lives, 0
        for layer in range(self.store.config.layers):
            rows = torch.stack([row(loc, layer, self.life[loc]) for loc in locs])
            self.store.write(layer, torch.tensor(locs), rows)
        return locs

    def start(self, prompt: int) -> int:
        shared: list[int] = []
        if self.running and self.rng.random() < 0.6:  # a prefix-cache hit: the other's first loc
            other = self.rng.choice(list(self.running.values()))
            shared = other[: self.rng.randint(1, len(other))]
        locs = shared + self.alloc(max(prompt - len(shared), 1))
        slot = self.free_req_slots.pop()
        for loc in locs:
            self.holders[loc] += 1
        self.req_to_token[slot, : len(locs)] = torch.tensor(locs, dtype=torch.int32)
        self.running[slot] = locs
        return slot

    def extend(self, slots: list[int]) -> None:
        """A decode step's new tokens, one per request, allocated and written together (SGLang's
        ``alloc_decode`` for the batch, then one ``set_mla_kv_buffer`` per layer)."""
        for slot, loc in zip(slots, self.alloc(len(slots)), strict=True):
            self.holders[loc] += 1
            seq = self.running[slot]
            self.req_to_token[slot, len(seq)] = loc
            seq.append(loc)

    def finish(self, slot: int) -> None:
        gone = []
        for loc in self.running.pop(slot):
            self.holders[loc] -= 1
            if self.holders[loc] == 0:
                del self.holders[loc]
                gone.append(loc)
        self.req_to_token[slot] = 0
        self.free_req_slots.append(slot)
        if gone:
            self.store.release(torch.tensor(gone))
            self.free_loc.extend(gone)

    def topk(self, slots: list[int], queries: int, k: int) -> torch.Tensor:
        """The indexer's choice: up to ``k`` distinct positions of each request, -1 padded."""
        out = torch.full((len(slots), queries, k), -1, dtype=torch.int32)
        for i, slot in enumerate(slots):
            n = len(self.running[slot])
            for q in range(queries):
                chosen = self.rng.sample(range(n), min(k, n))
                out[i, q, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        return out

    def expected(self, slots: list[int], topk: torch.Tensor, layer: int) -> torch.Tensor:
        want = torch.zeros((*topk.shape, BYTES), dtype=torch.uint8)
        for i, slot in enumerate(slots):
            for idx in zip(*torch.nonzero(topk[i] >= 0, as_tuple=True), strict=True):
                loc = self.running[slot][int(topk[i][idx])]
                want[(i, *idx)] = row(loc, layer, self.life[loc])
        return want


def check_read(
    store: SGLangStore, engine: Engine, slots_out: torch.Tensor, reqs: list[int], topk, layer: int
):
    kv = store.kv_rows(layer).view(-1, BYTES)
    valid = slots_out >= 0
    assert torch.equal(valid, topk >= 0), "a slot for each selected position, -1 for padding"
    got = kv[slots_out.clamp(min=0).long()]
    want = engine.expected(reqs, topk, layer)
    assert torch.equal(got[valid], want[valid])


@pytest.mark.parametrize(
    ("layers", "groups", "queries", "k", "seed"),
    [(2, 1, 1, 6, 0), (2, 2, 1, 5, 1), (2, 2, 2, 3, 2), (3, (False, False, True), 1, 5, 3)],
    ids=["g1-decode-k6", "g2-decode-k5", "g2-verify-q2-k3", "skip-topk-1-2-decode-k5"],
)
def test_decode_loop_through_sglang_transform(
    transform, layers: int, groups: int | tuple[bool, ...], queries: int, k: int, seed: int
):
    """8+ requests with shared prefixes arrive and leave over 20 steps, a few at once (a step selects
    at most the 24 slots of the GPU cache) under up to 96 live tokens; every row read through the
    slots is the one written. ``groups``: layers a group, or SGLang's ``skip_topk_layers`` (a layer
    that reuses the previous layer's top-k joins its group, prepared once a step)."""
    at_once = min(4, 24 // (queries * k))
    skips = groups if isinstance(groups, tuple) else None
    cfg = StoreConfig(
        layers=layers,
        bytes_per_token=BYTES,
        device_tokens=24,
        logical_tokens=96,
        max_batch=5,
        max_queries=queries,
        top_k=k,
        layers_per_group=1 if skips else groups,
        group_starts=group_starts_from_skips(skips) if skips else None,
    )
    store = SGLangStore(cfg)
    prepares = []
    plain_prepare = store.kv.prepare
    store.kv.prepare = lambda group, topk: prepares.append(group) or plain_prepare(group, topk)
    coord = UlakvSparseCoordinator.from_store(
        store, torch.zeros(1, dtype=torch.int32), k, transform.transform_index_page_table_decode
    )
    engine = Engine(store, slots=9, context=64, seed=seed)
    coord.req_to_token = engine.req_to_token
    started = 0
    for _step in range(20):
        room = len(engine.free_loc) >= 12 + at_once  # SGLang admits only what its allocator can hold
        if started < 12 and len(engine.running) < at_once and room and engine.rng.random() < 0.8:
            engine.start(engine.rng.randint(3, 12))
            started += 1
        while engine.running and len(engine.free_loc) < len(engine.running):  # out of slots: retract
            engine.finish(next(iter(engine.running)))
        if not engine.running:
            continue
        reqs = list(engine.running)
        engine.extend(reqs)
        topk = engine.topk(reqs, queries, k)
        # A captured batch: one padding request (slot 0, garbage positions) past num_real_reqs.
        req_pool_indices = torch.tensor([*reqs, 0], dtype=torch.int64)
        batch_topk = torch.cat([topk, torch.randint(0, 3, (1, queries, k), dtype=torch.int32)])
        if queries == 1:
            batch_topk = batch_topk.squeeze(1)
        seq_lens = torch.tensor([len(engine.running[s]) for s in reqs] + [1])
        coord.num_real_reqs.fill_(len(reqs))
        prepares.clear()
        for layer in range(layers):
            slots_out = coord.swap_in_selected_pages(req_pool_indices, seq_lens, batch_topk, layer)
            assert slots_out.dtype == torch.int32 and slots_out.shape == batch_topk.shape
            slots_out = slots_out.view(len(reqs) + 1, queries, k)
            assert bool((slots_out[-1] == -1).all()), "a padding request reads nothing"
            check_read(store, engine, slots_out[:-1], reqs, topk, layer)
        assert prepares == list(range(store.pool.config.num_groups)), "each group prepared once a step"
        if engine.rng.random() < 0.4 or len(engine.running[reqs[0]]) > 40:
            finished = engine.rng.choice(reqs)
            coord.request_finished(object())
            engine.finish(finished)
        store.pool.check_invariants()
    stats = store.pool.stats()
    assert started >= 8
    assert stats["misses"] > 0 and stats["victims"] > 0, "the GPU cache was under pressure"
    assert stats["live_addresses"] == len(engine.holders)
    for slot in list(engine.running):
        engine.finish(slot)
    assert store.pool.stats()["live_addresses"] == 0


def test_full_width_top_k_takes_sglangs_2048_kernel(transform):
    """top-k 2048 (the models' width): SGLang's single-program decode kernel, two requests of 2100
    tokens sharing 700, one layer."""
    cfg = StoreConfig(
        layers=1, bytes_per_token=BYTES, device_tokens=4096, logical_tokens=4200, max_batch=2, top_k=2048
    )
    store = SGLangStore(cfg)
    engine = Engine(store, slots=3, context=2200, seed=7)
    first = engine.start(2100)
    engine.rng.random = lambda: 0.0  # the second request hits the prefix cache
    second = engine.start(2100)
    coord = UlakvSparseCoordinator.from_store(
        store, engine.req_to_token, 2048, transform.transform_index_page_table_decode
    )
    reqs = [first, second]
    topk = engine.topk(reqs, 1, 2048)
    coord.num_real_reqs.fill_(2)
    out = coord.swap_in_selected_pages(torch.tensor(reqs), torch.tensor([2100, 2100]), topk.squeeze(1), 0)
    check_read(store, engine, out.view(2, 1, 2048), reqs, topk, 0)


def test_prefill_through_sglangs_prefill_transform(transform):
    """A prompt's queries select through ``transform_index_page_table_prefill``; the store makes the
    selected ``loc`` resident and every row reads back; a prompt selecting more than one prepare may
    is refused, with nothing changed."""
    cfg = StoreConfig(
        layers=2, bytes_per_token=BYTES, device_tokens=16, logical_tokens=64, max_batch=4, top_k=4
    )
    store = SGLangStore(cfg)
    engine = Engine(store, slots=3, context=40, seed=11)
    slot = engine.start(30)
    seq = engine.running[slot]
    positions = torch.full((6, 4), -1, dtype=torch.int32)
    for t in range(6):  # the last 6 prompt tokens as queries, causal: each picks among [0, 24 + t]
        chosen = engine.rng.sample(range(24 + t + 1), 4)
        positions[t] = torch.tensor(chosen, dtype=torch.int32)
    page_table = engine.req_to_token[slot : slot + 1]
    locs = transform.transform_index_page_table_prefill(page_table, positions, [6], page_size=1)
    assert torch.equal(locs[positions >= 0].long(), torch.tensor(seq)[positions[positions >= 0].long()])
    for layer in range(2):
        slots_out = store.prefill_slots(layer, locs)
        kv = store.kv_rows(layer).view(-1, BYTES)
        for t in range(6):
            for j in range(4):
                loc = seq[int(positions[t, j])]
                assert torch.equal(kv[int(slots_out[t, j])], row(loc, layer, engine.life[loc]))
    wide = torch.tensor(seq[:17], dtype=torch.int32).view(1, 17)  # 17 distinct > 16 GPU slots
    before = store.pool.state_dict()
    with pytest.raises(CapacityError):
        store.prefill_slots(0, wide)
    after = store.pool.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before if key != "pending")


def test_lifecycle_calls_follow_sglangs_order(transform):
    """Admitted after prefill, collected once for decode; a retracted request in staging leaves the
    queue; stats count tokens on each tier."""
    store = SGLangStore(
        StoreConfig(layers=1, bytes_per_token=BYTES, device_tokens=8, logical_tokens=24, top_k=4)
    )
    coord = UlakvSparseCoordinator.from_store(
        store, torch.zeros((2, 8), dtype=torch.int32), 4, transform.transform_index_page_table_decode
    )

    class Req:  # what SGLang's scheduler hands the coordinator: the coordinator sets the flag only
        hisparse_staging = False

    a, b = Req(), Req()
    coord.admit_request_into_staging(a)
    coord.admit_request_into_staging(b)
    assert coord.has_ongoing_staging() and a.hisparse_staging
    coord.retract_req(b)
    assert [act.req for act in coord.ack_staging_queue] == [a]
    assert coord.collect_ready_reqs() == [a] and not a.hisparse_staging
    assert not coord.has_ongoing_staging() and coord.collect_ready_reqs() == []
    engine = Engine(store, slots=2, context=16, seed=3)
    engine.start(12)  # 12 tokens: 8 on the GPU, 4 evicted to the CPU by the writes
    stats = coord.get_token_stats()
    assert stats.device_tokens + stats.host_tokens == 12 and stats.device_tokens == 8


def test_coordinator_bounds_grow_to_speculative_verify(transform):
    """The KV pool is built before SGLang says how many draft tokens verify sends; the coordinator
    grows the store's step buffers to ``[B, Q, K]`` before the first step."""
    store = SGLangStore(
        StoreConfig(layers=1, bytes_per_token=BYTES, device_tokens=16, logical_tokens=40, top_k=4)
    )
    assert store.kv.max_queries == 1
    store.bound(max_queries=3, top_k=4)
    assert (store.kv.max_queries, store.kv.top_k) == (3, 4)
    engine = Engine(store, slots=2, context=16, seed=5)
    slot = engine.start(10)
    coord = UlakvSparseCoordinator.from_store(
        store, engine.req_to_token, 4, transform.transform_index_page_table_decode
    )
    topk = engine.topk([slot], 3, 4)
    coord.num_real_reqs.fill_(1)
    out = coord.swap_in_selected_pages(torch.tensor([slot]), torch.tensor([10, 10, 10]), topk, 0)
    check_read(store, engine, out, [slot], topk, 0)


@pytest.mark.parametrize(
    ("cls", "method", "args"),
    [
        ("UlakvKVPoolMixin", "register_mapping", (torch.zeros(1),)),
        ("UlakvKVPoolMixin", "transfer_values_on_device", (torch.zeros(1), torch.zeros(1))),
        ("UlakvKVPoolMixin", "get_cpu_copy", (None,)),
        ("UlakvKVPoolMixin", "load_cpu_copy", (None, None)),
        ("UlakvAllocatorMixin", "alloc_device_buffer", (torch.zeros(1), 1)),
    ],
    ids=["register-mapping", "transfer-values", "get-cpu-copy", "load-cpu-copy", "alloc-device-buffer"],
)
def test_what_is_not_served_is_refused_by_name(cls: str, method: str, args: tuple) -> None:
    """HiSparse paths the adapter does not serve raise the adapter's error, which is a ``UlakvError``
    and the ``NotImplementedError`` SGLang's own pools raise for what they do not serve."""
    from ulakv.errors import UlakvError
    from ulakv.integrations.sglang import UnsupportedBySGLangAdapter, allocator, kv_pool

    owner = getattr(kv_pool if cls == "UlakvKVPoolMixin" else allocator, cls)
    with pytest.raises(UnsupportedBySGLangAdapter) as refused:
        getattr(owner, method)(object(), *args)  # refused before the instance is looked at
    assert isinstance(refused.value, UlakvError) and isinstance(refused.value, NotImplementedError)
