"""CPU suite: what the tools cost and what a group-step moves, side by side in one run.

    pytest benchmarks/test_cpu_suite.py benchmarks/test_victim_search.py --benchmark-only

Timings are the Triton interpreter's on a CPU (work, not GPU speed); the figures that carry over to a
GPU are in ``extra_info``: launches counted at Triton's entry, bytes moved, hit rates. The summary
table printed at the end (``benchmarks/conftest.py``) is what ``RESULTS.md`` quotes.
"""

from __future__ import annotations

import pytest
import torch

from ulakv import PBLRU, EntrySpec, ExactLRU, Pool, PoolConfig, Tiered
from ulakv.engine import SparseKV
from ulakv.kernels._triton import count_launches
from ulakv.replay import replay
from ulakv.traces import SyntheticSpec, synthetic

POLICIES = [ExactLRU(), PBLRU(8)]
TRACE = SyntheticSpec(
    requests=6, prompt=(300, 500), steps=12, topk=48, queries=3, groups=2, window=12, heavy=16, seed=4
)


@pytest.fixture(scope="module")
def trace():
    return synthetic(TRACE)


@pytest.mark.parametrize("backend", ["model", "pool"])
@pytest.mark.parametrize("policy", POLICIES, ids=["exact_lru", "pblru8"])
def test_replay_throughput(benchmark, trace, policy, backend) -> None:
    """Accesses replayed per second by the policy model and by the real pool (interpreted kernels),
    same trace, same decisions (the hit counts must agree)."""
    gpu = int(1.5 * trace.working_set())
    benchmark.group = f"replay {policy}"
    result = benchmark.pedantic(lambda: replay(trace, policy, gpu, backend=backend), rounds=1, iterations=1)
    accesses = result.hits + result.misses
    benchmark.extra_info.update(
        accesses=accesses,
        hit_rate=round(result.hit_rate, 4),
        accesses_per_s=round(accesses / benchmark.stats.stats.mean),
    )


def engine_pool(policy, gpu: int, cpu: int, layers_per_group: int) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=656),
            num_layers=2 * layers_per_group,
            layers_per_group=layers_per_group,
            layout=Tiered(gpu_slots=gpu, cpu_slots=cpu, policy=policy),
            validate=False,
        )
    )


LAYOUTS = [
    # id, GPU slots (x working set), CPU tier, layers a group, prefetch split
    ("gpu-only", None, False, 1, False),
    ("tiered-1.5x", 1.5, True, 1, False),
    ("tiered-1.5x-4layers-split", 1.5, True, 4, True),
]


@pytest.mark.parametrize(
    ("name", "scale", "tiered", "per_group", "split"), LAYOUTS, ids=[x[0] for x in LAYOUTS]
)
@pytest.mark.parametrize("policy", POLICIES, ids=["exact_lru", "pblru8"])
def test_group_step_launches_and_bytes(
    benchmark, trace, policy, name, scale, tiered, per_group, split
) -> None:
    """One decode step of every request through the engine adapter: launches per group-step
    (counted at Triton's entry) and bytes moved per group-step, for each policy and layout."""
    history = sum(r.prompt_len + r.steps for r in trace.requests)
    gpu = int(scale * trace.working_set()) if tiered else history
    pool = engine_pool(policy, gpu, history if tiered else 0, per_group)
    kv = SparseKV(
        pool, max_batch=len(trace.requests), top_k=trace.topk, max_queries=trace.queries, prefetch=split
    )
    seqs = [pool.admit(r.prompt_len + r.steps) for r in trace.requests]
    for layer in range(pool.config.num_layers):
        for seq in seqs:
            kv.write(layer, seq.addresses, torch.zeros((len(seq), 656), dtype=torch.uint8))
    steps = min(r.steps for r in trace.requests)
    selections = [
        [
            torch.stack(
                [
                    torch.where(r.topk[s, g] >= 0, seq.addresses[r.topk[s, g].clamp(min=0).long()], -1)
                    for r, seq in zip(trace.requests, seqs, strict=True)
                ]
            )
            for g in range(pool.num_groups)
        ]
        for s in range(steps)
    ]
    before = pool.stats()
    launches: list[int] = []

    def run_steps() -> None:
        for per_group_sel in selections:
            for group, sel in enumerate(per_group_sel):
                with count_launches() as names:
                    kv.prepare(group, sel)
                launches.append(len(names))

    benchmark.group = f"group-step {name}"
    benchmark.pedantic(run_steps, rounds=1, iterations=1)
    after = pool.stats()
    group_steps = steps * pool.num_groups
    benchmark.extra_info.update(
        launches_per_group_step=max(launches),
        kb_in_per_group_step=round((after["bytes_in"] - before["bytes_in"]) / group_steps / 1e3, 2),
        kb_out_per_group_step=round((after["bytes_out"] - before["bytes_out"]) / group_steps / 1e3, 2),
        hit_rate=round(
            (after["hits"] - before["hits"])
            / max(1, after["hits"] - before["hits"] + after["misses"] - before["misses"]),
            4,
        ),
        ms_per_group_step=round(benchmark.stats.stats.mean / group_steps * 1e3, 1),
    )
