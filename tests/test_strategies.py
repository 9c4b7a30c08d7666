"""The kit's strategies produce what they promise: pools that build and serve, traces that replay."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from ulakv import PBLRU, Pool
from ulakv.replay import replay
from ulakv.testing import kernel_settings, pool_configs, trace_specs
from ulakv.traces import synthetic


@settings(kernel_settings(max_examples=15))
@given(cfg=pool_configs(max_gpu_slots=12))
def test_pool_configs_build_pools_that_serve(cfg) -> None:
    pool = Pool(cfg)
    n = min(pool.capacity, 5)
    seq = pool.admit(n)
    rows = torch.arange(n * cfg.entry.bytes_per_layer, dtype=torch.int64).remainder(251).to(torch.uint8)
    rows = rows.view(n, cfg.entry.bytes_per_layer)
    for layer in range(cfg.num_layers):
        pool.write(layer, seq.addresses, rows)
    k = min(n, cfg.layout.gpu_slots)
    slots = pool.prepare(0, seq.addresses[:k].view(1, k)).slots
    assert torch.equal(pool.gpu_buffer(0)[slots[0].long()], rows[:k])
    pool.check_invariants()


# The strategy is what is under test, so the policies' models replay it (they decide what the kernels
# do: test_traces.py holds the two replays equal): 30 specs in 0.1 s, where 10 on the
# interpreted kernels took 17 s.
@settings(max_examples=30)
@given(spec=trace_specs(max_requests=2, max_steps=3))
def test_trace_specs_replay(spec) -> None:
    trace = synthetic(spec)
    result = replay(trace, PBLRU(2), max(trace.working_set(), 1), bytes_per_layer=4, backend="model")
    assert result.hits + result.misses == sum(
        int(r.topk[s, g][r.topk[s, g] >= 0].unique().numel())
        for r in trace.requests
        for s in range(r.steps)
        for g in range(trace.groups)
    )
    assert result.hit_rate <= result.belady_hit_rate  # same denominator: the distinct accesses
