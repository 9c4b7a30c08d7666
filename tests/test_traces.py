"""Synthetic traces, the SGLang loader, save/load, and replay through a real pool."""

from __future__ import annotations

import pytest
import torch

from ulakv import PBLRU, CPUOffloadBaseline, ExactLRU
from ulakv.replay import replay
from ulakv.traces import SyntheticSpec, Trace, synthetic

SMALL = SyntheticSpec(requests=3, prompt=(96, 160), steps=6, topk=32, heavy=8, window=8, arrival_spread=3)


def test_synthetic_trace_is_seeded_and_well_formed() -> None:
    a, b = synthetic(SMALL), synthetic(SMALL)
    other = synthetic(SyntheticSpec(**{**SMALL.__dict__, "seed": 1}))
    assert all(torch.equal(x.topk, y.topk) for x, y in zip(a.requests, b.requests, strict=True))
    assert any(not torch.equal(x.topk, y.topk) for x, y in zip(a.requests, other.requests, strict=True))
    for r in a.requests:
        assert r.topk.shape == (SMALL.steps, SMALL.groups, SMALL.queries, SMALL.topk)
        for s in range(r.steps):
            picks = r.topk[s]
            assert int(picks.max()) < r.prompt_len + s + 1  # only tokens that exist
            assert int(picks[picks >= 0].min()) >= 0
            assert set(range(SMALL.sinks)) <= set(picks[0, 0].tolist())  # sinks always picked
            newest = r.prompt_len + s
            assert newest in picks[0, 0].tolist()  # the local window includes the newest token


def test_trace_save_load_roundtrip(tmp_path) -> None:
    trace = synthetic(SMALL)
    trace.save(tmp_path / "t.pt")
    loaded = Trace.load(tmp_path / "t.pt")
    assert [(r.prompt_len, r.arrival) for r in loaded.requests] == [
        (r.prompt_len, r.arrival) for r in trace.requests
    ]
    assert all(torch.equal(x.topk, y.topk) for x, y in zip(loaded.requests, trace.requests, strict=True))
    torch.save({"format": "other"}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a ulakv trace"):
        Trace.load(tmp_path / "bad.pt")


def test_sglang_indexer_topk_loader() -> None:
    seqlen, layers, k, prompt = 5, 3, 4, 50
    rows = torch.stack([torch.randint(0, prompt + i + 1, (layers, k)) for i in range(seqlen)]).to(torch.int32)
    rows[0, 0, 0] = prompt - 1
    rows[2, 1, 3] = -1
    trace = Trace.from_sglang([rows], prompt_lens=[prompt])
    assert trace.groups == layers and trace.queries == 1 and trace.topk == k
    assert torch.equal(trace.requests[0].topk[:, :, 0], rows)
    inferred = Trace.from_sglang([rows])
    assert inferred.requests[0].prompt_len == int(rows[0].max()) + 1
    with pytest.raises(ValueError, match="beyond"):
        Trace.from_sglang([rows], prompt_lens=[3])
    with pytest.raises(ValueError, match="seqlen, layers, topk"):
        Trace.from_sglang([rows[0]])


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(4)], ids=["exact-lru", "pblru4"])
def test_replay_reports_consistent_numbers(policy) -> None:
    trace = synthetic(SMALL)
    gpu = int(trace.working_set() * 1.5)
    result = replay(trace, policy, gpu, bytes_per_layer=8)
    busy = {r.arrival + s for r in trace.requests for s in range(r.steps)}
    assert result.prepares == trace.groups * len(busy) and result.steps == trace.horizon
    assert result.hits + result.misses > 0
    assert 0 < result.hit_rate <= result.belady_hit_rate <= 1
    assert result.bytes_in_per_step * result.steps % 8 == 0


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["exact-lru", "pblru3"])
def test_model_replay_equals_pool_replay(policy) -> None:
    """The plain models decide exactly what the kernels decide, down to the bytes moved, so large
    suites may replay on the models."""
    trace = synthetic(SMALL)
    gpu = int(trace.working_set() * 1.2)
    pool = replay(trace, policy, gpu, bytes_per_layer=8, layers_per_group=2)
    model = replay(trace, policy, gpu, bytes_per_layer=8, layers_per_group=2, backend="model")
    for field in ("hits", "misses", "bytes_in_per_step", "bytes_out_per_step", "victims", "belady_hit_rate"):
        assert getattr(pool, field) == getattr(model, field), field
    # Row for row: the same victims go back to their CPU copies without a copy.
    assert pool.pool_stats["clean_evictions"] == model.pool_stats["clean_evictions"] > 0


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["exact-lru", "pblru3"])
def test_fused_model_replay_equals_pool_replay(policy) -> None:
    """One plan a group a step (``prepare(..., new=)``): the models (``CPUTierModel.prepare_new``)
    decide what the kernels decide, bytes and clean evictions included, at a GPU tier tight enough
    that new tokens evict."""
    trace = synthetic(SMALL)
    gpu = int(trace.working_set() * 1.2)
    pool = replay(trace, policy, gpu, bytes_per_layer=8, fused=True)
    model = replay(trace, policy, gpu, bytes_per_layer=8, backend="model", fused=True)
    for field in ("hits", "misses", "bytes_in_per_step", "bytes_out_per_step", "victims", "belady_hit_rate"):
        assert getattr(pool, field) == getattr(model, field), field
    assert pool.pool_stats["clean_evictions"] == model.pool_stats["clean_evictions"] > 0
    # Apart, a selected new token is a hit (written just before); in one plan it is written, not
    # counted: the accesses differ by exactly the new tokens the selections name.
    apart = replay(trace, policy, gpu, bytes_per_layer=8, backend="model")
    named = sum(
        int((r.topk[s, g] == r.prompt_len + s).any())
        for r in trace.requests
        for s in range(r.steps)
        for g in range(trace.groups)
    )
    assert apart.hits + apart.misses - (model.hits + model.misses) == named > 0
    with pytest.raises(ValueError, match="one-layer groups"):
        replay(trace, policy, gpu, bytes_per_layer=8, layers_per_group=2, backend="model", fused=True)


def test_offload_model_replay_equals_offload_pool_replay() -> None:
    """The CPU-offload baseline's models (one exact LRU a request and group) decide what its
    buffer kernels decide, bytes and peak occupancy included."""
    trace = synthetic(SMALL)
    total = sum(r.prompt_len + r.steps for r in trace.requests)
    alive = len(trace.requests)
    per_request = max(
        int(r.topk[s, g][r.topk[s, g] >= 0].unique().numel())
        for r in trace.requests
        for s in range(r.steps)
        for g in range(trace.groups)
    )
    layout = CPUOffloadBaseline(cpu_slots=total, slots_per_request=per_request + 3, max_requests=alive)
    kw = dict(bytes_per_layer=8, layers_per_group=2, layout=layout)
    pool = replay(trace, ExactLRU(), alive * (per_request + 3), **kw)
    model = replay(trace, ExactLRU(), alive * (per_request + 3), backend="model", **kw)
    assert pool.victims > 0  # the quotas are tight: entries leave the buffers
    for field in ("hits", "misses", "bytes_in_per_step", "bytes_out_per_step", "victims"):
        assert getattr(pool, field) == getattr(model, field), field
    assert (pool.peak_distinct_entries, pool.peak_physical_slots) == (
        model.peak_distinct_entries,
        model.peak_physical_slots,
    )
    assert pool.system == model.system == "cpu_offload" and 0 < pool.distinct_per_slot < 1
