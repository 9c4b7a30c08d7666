"""End to end: the reference decoder's logits are bit-identical with all KV in one dense tensor and
with the KV in a pool under pressure (GPU slots ~1.5x one step's working set, the rest on the CPU),
prompts fed token by token or in one bulk prefill pass, through ulakv's pool or the CPU-offload
baseline."""

from __future__ import annotations

import random

import pytest
import torch

from ulakv import PBLRU, CPUOffloadBaseline, ExactLRU, Tiered
from ulakv.engine.reference import DecoderSpec, DenseKV, PoolKV, Request, TinyDecoder, decode, generate


def workload(seed: int = 0) -> list[Request]:
    """8 requests arriving over steps 0..6 and finishing at different steps (34 steps in all)."""
    rng = random.Random(seed)
    return [
        Request(
            tuple(rng.randrange(97) for _ in range(rng.randint(4, 12))),
            rng.randint(16, 24),
            rng.randint(0, 6),
        )
        for _ in range(8)
    ]


class Recording(DenseKV):
    """Dense store that remembers the largest number of distinct positions one group selects."""

    working_set = 0

    def select(self, group, rids, positions):
        distinct = sum(int(positions[b][positions[b] >= 0].unique().numel()) for b in range(len(rids)))
        Recording.working_set = max(Recording.working_set, distinct)
        return positions


# Each policy once, each query shape once; the bulk-prefill test below and the demo cover PB-LRU with
# 3 query positions again. Every step costs a plan per write and per group's prepare (interpreted
# kernels, a fixed cost each), so the workload is as short as keeps the pressure: 34 steps, top-8
# (working set 64 and 71 entries, GPU 96 and 106 slots, history 227), 3 layers in a group of 2 (its
# prepare split in two launches) and a group of 1 (not split). Measured: victims in 29 and 23 of the
# 68 group-steps, swap-ins from the CPU in 38 and 30, clean evictions in 22 and 11 (LRU and PB-LRU;
# the earlier 77 steps of top-24 over 4 layers: 36/28, 48/39, 25/10 of 154, three times the time).
@pytest.mark.parametrize(
    ("policy", "queries"), [(ExactLRU(), 1), (PBLRU(4), 3)], ids=["exact-lru-no-spec", "pblru4-spec-q3"]
)
def test_pool_logits_equal_dense_logits(policy, queries) -> None:
    spec = DecoderSpec(topk=8, queries=queries, layers=3)
    requests = workload()
    model = TinyDecoder(spec)
    max_len = max(len(r.prompt) + r.new_tokens for r in requests)
    Recording.working_set = 0
    dense = generate(model, Recording(spec, len(requests), max_len), requests)
    assert len(dense) >= 32
    history = sum(len(r.prompt) + r.new_tokens for r in requests)
    gpu = int(1.5 * Recording.working_set)
    assert gpu < history  # real pressure: most of the history must live on the CPU at some point
    store = PoolKV(spec, Tiered(gpu_slots=gpu, cpu_slots=history, policy=policy))
    pooled = generate(model, store, requests)
    assert len(pooled) == len(dense)
    for step, (a, b) in enumerate(zip(dense, pooled, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ"
    stats = store.pool.stats()
    assert stats["misses"] > 0 and stats["victims"] > 0  # entries really went to the CPU and back
    assert stats["bytes_in"] > 0 and stats["clean_evictions"] > 0  # rows back from CPU homes, clean victims
    assert stats["live_addresses"] == 0


@pytest.mark.parametrize(
    "layout",
    [
        Tiered(gpu_slots=80, cpu_slots=72, staging_slots=80, policy=PBLRU(4)),
        CPUOffloadBaseline(cpu_slots=152, slots_per_request=24, max_requests=3),
    ],
    ids=["tiered", "cpu-offload"],
)
def test_bulk_prefill_logits_equal_dense_logits(layout) -> None:
    """Prompts computed in one pass (two arrive together, so one write a layer covers both), then
    decoded through a pool whose GPU side holds about half the history: bit-identical to dense."""
    spec = DecoderSpec(topk=8, queries=3)
    rng = random.Random(3)
    requests = [
        Request(tuple(rng.randrange(97) for _ in range(rng.randint(36, 44))), 4, arrival)
        for arrival in (0, 0, 2)
    ]
    model = TinyDecoder(spec)
    dense = decode(model, DenseKV(spec, len(requests), 48), requests, prefill=True)
    assert len(dense.logits) == 2 + 5  # two prefill passes (steps 0 and 2), five decode steps
    store = PoolKV(spec, layout)
    pooled = decode(model, store, requests, prefill=True)
    assert len(pooled.logits) == len(dense.logits) and pooled.tokens == dense.tokens
    for step, (a, b) in enumerate(zip(dense.logits, pooled.logits, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ"
    stats = store.pool.stats()
    assert stats["misses"] > 0 and stats["live_addresses"] == 0  # entries really came from the CPU
