"""The capacity model: real pools on the meta device, budgets respected, counts that agree with
an independent count of the same requests, and the published shape of the comparison."""

from __future__ import annotations

import itertools
import json

import pytest

from ulakv.capacity import (
    BASELINES,
    SYSTEMS,
    ULAKV_MODES,
    Scenario,
    SelectionShape,
    Workload,
    _largest,
    _reserve,
    fit_systems,
    pool_bytes,
    published_scenarios,
)
from ulakv.cli import main
from ulakv.config import EntrySpec, PoolConfig, Striped, Tiered
from ulakv.errors import CapacityError
from ulakv.pool import Pool
from ulakv.presets import GB, HARDWARE, MODELS

CONFIGS = list(itertools.product(["H200", "B300"], ["TP", "DP"], [True, False]))

# A fixed working-set shape keeps these tests independent of the trace generator.
SHAPE = {
    True: SelectionShape(union=1.18, home_share=0.15, source="test"),
    False: SelectionShape(union=1.0, home_share=0.15, source="test"),
}


@pytest.fixture(scope="module")
def published() -> list[dict]:
    """``ulakv capacity --json --explain`` for the 8 published configurations (one run, shared)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["capacity", "--json", "--explain"]) == 0
    return json.loads(out.getvalue())


def test_json_lists_every_configuration_and_system(published) -> None:
    keys = {(r["gpu"], r["mode"], r["spec"], r["system"]) for r in published}
    assert SYSTEMS == ("gpu_only", "cpu_offload", "dcp", "ulakv", "ulakv_local")
    assert keys == {(*c, s) for c in CONFIGS for s in SYSTEMS} and len(published) == 40
    assert all(isinstance(r["admitted"], int) and r["admitted"] > 0 for r in published)


def _admitted(published) -> dict:
    return {(r["gpu"], r["mode"], r["spec"], r["system"]): r["admitted"] for r in published}


def test_ulakv_best_mode_admits_at_least_the_best_baseline(published) -> None:
    by = _admitted(published)
    for c in CONFIGS:
        ours = max(by[(*c, s)] for s in ULAKV_MODES)
        assert ours >= max(by[(*c, s)] for s in BASELINES), c
        # The same striping plus a CPU tier; under DP both are a DCP group of one rank.
        assert by[(*c, "ulakv_local")] >= by[(*c, "dcp")], c


def test_dcp_removes_the_replication_under_tp_and_is_gpu_only_under_dp(published) -> None:
    by = _admitted(published)
    for gpu, mode, spec in CONFIGS:
        if mode == "TP":  # each rank 1/world of every request instead of a full copy
            assert by[(gpu, mode, spec, "dcp")] > 4 * by[(gpu, mode, spec, "gpu_only")], (gpu, spec)
        else:  # DP attention leaves no attention-TP group to split
            assert by[(gpu, mode, spec, "dcp")] == by[(gpu, mode, spec, "gpu_only")], (gpu, spec)
            assert by[(gpu, mode, spec, "ulakv_local")] == by[(gpu, mode, spec, "ulakv")], (gpu, spec)


def test_explain_says_what_each_system_pays_and_holds(published) -> None:
    rows = {(r["gpu"], r["mode"], r["spec"], r["system"]): r for r in published}
    tp = {s: rows[("H200", "TP", True, s)]["pays"] for s in SYSTEMS}
    assert "buffer of" in tp["ulakv"] and "all-gather of" in tp["ulakv"] and "rows" in tp["ulakv"]
    for local in ("dcp", "ulakv_local"):
        assert "partial outputs + LSE" in tp[local] and "top-k merge" in tp[local]
        assert "no buffer" in tp[local]
    assert "no CPU tier" in tp["dcp"] and "CPU" in tp["ulakv_local"]
    assert "full CPU copy" in tp["cpu_offload"] and "per-request GPU buffers" in tp["cpu_offload"]
    assert "a DCP group of one rank" in rows[("H200", "DP", True, "dcp")]["pays"]
    # The admitted ratio follows the distinct tokens the pools admit.
    for c in CONFIGS:
        ours = max((rows[(*c, s)] for s in ULAKV_MODES), key=lambda r: r["admitted"])
        theirs = max((rows[(*c, s)] for s in BASELINES), key=lambda r: r["admitted"])
        held = ours["distinct_tokens_held"] / theirs["distinct_tokens_held"]
        assert held == pytest.approx(ours["admitted"] / theirs["admitted"], rel=0.1), c
    what = {a["what"]: a for a in published[0]["assumptions"]}
    assert "vllm-project/vllm#46076" in what["DCP: index keys"]["source"]
    assert "striped" in what["DCP: index keys"]["value"]


def test_the_published_shape(published) -> None:
    """Published (GLM-5.3, speculation on): H200 DP gains about a tenth over the CPU-offload
    baseline, B300 DP nearly doubles, TP gains most (B300 TP almost 10x)."""
    by = {(r["gpu"], r["mode"], r["system"]): r["admitted"] for r in published if r["spec"]}
    ratio = {
        (g, m): by[(g, m, "ulakv")] / by[(g, m, "cpu_offload")]
        for g in ("H200", "B300")
        for m in ("TP", "DP")
    }
    assert 1.0 < ratio[("H200", "DP")] < 1.3
    assert 1.4 < ratio[("B300", "DP")] < 2.3
    assert 6 < ratio[("B300", "TP")] < 16
    assert ratio[("H200", "TP")] > 3 * ratio[("H200", "DP")]  # the copies removed under TP


def test_every_number_fits_its_budgets(published) -> None:
    for r in published:
        b = r["breakdown"]
        gpu = b["kv_rows_gb"] + b["buffers_gb"] + b["index_keys_gb"] + b["metadata_gb"]
        # Each figure is rounded to 1e-3 GB: four of them summed are off by up to 2e-3.
        assert gpu <= b["kv_budget_gb"] + 2e-3, r
        assert b["cpu_rows_gb"] + b["cpu_staging_gb"] <= b["cpu_budget_gb"] + 1e-3, r
        assert r["pools"] and r["limit"]
    # ulakv pays for its mapping tables and policy state; the baselines are charged rows only.
    assert all(r["breakdown"]["metadata_gb"] > 0 for r in published if r["system"] in ULAKV_MODES)
    # Only the fetch mode (TP) keeps copies on the GPU beside the homes.
    for r in published:
        if r["system"] in ("dcp", "ulakv_local") or (r["system"] == "ulakv" and r["mode"] == "DP"):
            assert r["breakdown"]["buffers_gb"] == 0, r["system"]


@pytest.mark.parametrize(
    ("gpu", "mode", "spec"), [("h200", "TP", True), ("b300", "DP", False), ("b300", "TP", True)]
)
def test_every_system_fits_its_budgets_to_the_byte(gpu, mode, spec) -> None:
    sc = Scenario(MODELS["glm-5.3"], HARDWARE[gpu], mode, spec, shape=SHAPE[spec])
    for name, p in fit_systems(sc).systems.items():
        b = p.bytes_per_gpu
        assert 0 < b.gpu <= sc.kv_budget(), name
        assert b.cpu <= sc.hardware.cpu_bytes, name


def test_gpu_only_tp_matches_an_independent_count() -> None:
    """Replicated KV: every rank holds every request, so the count is how many of the stream's
    requests fit one GPU's KV budget, whatever the world size."""
    sc = Scenario(MODELS["glm-5.3"], HARDWARE["h200"], "TP", True, shape=SHAPE[True])
    got = fit_systems(sc, systems=("gpu_only",)).systems["gpu_only"].admitted
    per_token = sc.model.kv_layers(True) * 656 + sc.model.index_layers(True) * 132
    slots = (sc.kv_budget() - per_token) // per_token  # each pool keeps one dummy row a layer
    lengths = Workload().lengths(0, 100)
    fits = next(n for n in range(101) if sum(lengths[: n + 1]) > slots)
    assert got == fits


def test_dcp_tp_matches_an_independent_count() -> None:
    """Decode context parallelism: a rank holds the tokens of each request homed on it (address
    mod world, requests given consecutive runs of addresses) in as many slots as gpu_only's
    replica; the batch stops when rank 0's share no longer fits."""
    sc = Scenario(MODELS["glm-5.3"], HARDWARE["h200"], "TP", True, shape=SHAPE[True])
    got = fit_systems(sc, systems=("dcp",)).systems["dcp"].admitted
    per_token = sc.model.kv_layers(True) * 656 + sc.model.index_layers(True) * 132
    slots = (sc.kv_budget() - per_token) // per_token
    world, start, held, fits = sc.world, 0, 0, 0
    for length in Workload().lengths(0, 1000):
        held += -(-(start + length) // world) - -(-start // world)  # multiples of world in the run
        start += length
        if held > slots:
            break
        fits += 1
    assert got == fits and got > 30


def test_cpu_offload_is_bounded_by_its_full_cpu_copy() -> None:
    """HiSparse keeps every token on the CPU: with GPU to spare, the CPU budget decides."""
    sc = Scenario(MODELS["glm-5.3"], HARDWARE["b300"], "DP", False, shape=SHAPE[False])
    p = fit_systems(sc, systems=("cpu_offload",)).systems["cpu_offload"]
    history = sc.hardware.cpu_bytes // (sc.model.kv_layers(False) * 656) - 1
    expected = 0
    for rank in range(sc.world):
        lengths = Workload().lengths(rank, 200)
        expected += next(n for n in range(201) if sum(lengths[: n + 1]) > history)
    assert p.admitted == expected and "CPU" in p.limit


def test_staging_rows_and_buffers_are_counted() -> None:
    """ulakv's CPU rows include the staging rows a step's swaps need; the striped buffer holds one
    step's union of every request's selections."""
    sc = Scenario(MODELS["glm-5.3"], HARDWARE["h200"], "TP", True, shape=SHAPE[True])
    p = fit_systems(sc, systems=("ulakv",)).systems["ulakv"]
    n = p.admitted
    union = -(-int(1.18 * 2048 * 1000) // 1000)
    assert f"buffer_slots={n * union}" in p.pools[0]
    assert "staging_slots=" in p.pools[0]
    b = p.bytes_per_gpu
    assert b.cpu_staging > 0 and b.cpu <= sc.hardware.cpu_bytes
    assert b.gpu_buffers == (n * union + 1) * sc.model.kv_layers(True) * 656  # + the dummy row


def test_dp_attention_replicates_the_attention_weights() -> None:
    tp = Scenario(MODELS["glm-5"], HARDWARE["h200"], "TP", False)
    dp = Scenario(MODELS["glm-5"], HARDWARE["h200"], "DP", False)
    attention = MODELS["glm-5"].attention_weights(False)
    assert 10 * GB < attention < 20 * GB  # 78 layers of MLA + indexer projections in FP8
    assert dp.weights_per_gpu() - tp.weights_per_gpu() == pytest.approx(attention * 7 / 8, rel=1e-3)


@pytest.mark.parametrize("model", ["glm-5", "deepseek-v3.2"])
def test_other_presets_plan(model) -> None:
    sc = Scenario(MODELS[model], HARDWARE["b300"], "TP", False, shape=SHAPE[False])
    p = fit_systems(sc)
    n = {k: v.admitted for k, v in p.systems.items()}
    assert n["ulakv"] >= n["cpu_offload"] >= 1 and n["ulakv"] >= n["gpu_only"] >= 1
    assert n["ulakv_local"] >= n["dcp"] > n["gpu_only"]


def test_largest_finds_the_edge() -> None:
    for edge in (0, 1, 2, 7, 64, 1000):
        assert _largest(lambda n, e=edge: n <= e) == edge


def test_meta_pools_admit_hundreds_of_long_requests() -> None:
    """B300 TP: every candidate batch builds a striped meta pool and admits up to hundreds of
    66K-133K-token requests into it (runs of addresses, shape-only tensors)."""
    scenarios = published_scenarios()
    assert len(scenarios) == 8
    p = fit_systems(scenarios[4], systems=("ulakv",)).systems["ulakv"]
    assert p.admitted > 300 and p.bytes_per_gpu.gpu_rows > 50 * GB


def _local_pool(world: int, rank: int, inner: Tiered) -> Pool:
    layout = Striped(world=world, rank=rank, attention="local", inner=inner)
    return Pool(PoolConfig(EntrySpec(656), num_layers=3, layers_per_group=2, layout=layout, device="meta"))


def _fill(pool: Pool, lengths) -> int:
    """Admit requests of ``lengths`` until one is refused; the tokens admitted."""
    admitted = 0
    for n in lengths:
        try:
            pool.admit(n)
        except CapacityError:
            return admitted
        admitted += n
    return admitted


@pytest.mark.parametrize("rank", [0, 3])
def test_a_local_mode_pool_admits_every_rank_slots_and_keeps_no_copies(rank) -> None:
    """Striped(attention="local") over G GPU slots and C CPU rows a rank admits world x (G + C)
    tokens (nothing is reserved: the dummy and staging rows are not admitted into), and every
    physical row it keeps is one distinct entry's home: no buffer, no exchange."""
    world, inner = 4, Tiered(gpu_slots=96, cpu_slots=160, staging_slots=8)
    pool = _local_pool(world, rank, inner)
    admitted = _fill(pool, itertools.cycle((37, 5, 101, 64)))
    assert admitted < world * (96 + 160) < admitted + 101
    admitted += _fill(pool, itertools.repeat(1))  # the last tokens, one request each
    assert admitted == pool.capacity == world * (96 + 160)
    row = 3 * 656  # every layer of one row
    b, alone = pool_bytes(pool), pool_bytes(Pool(PoolConfig(EntrySpec(656), 3, inner, 2, "meta")))
    assert b.gpu_buffers == 0  # the rows are those of its slice alone
    assert all(getattr(b, k) == getattr(alone, k) for k in ("gpu_rows", "cpu_rows", "cpu_staging"))
    # Distinct entries / physical slots = 1.0: world ranks' homes, less one dummy row a tier.
    assert world * ((b.gpu_rows + b.cpu_rows) // row - 2) == admitted
    _reserve(pool, 4096)  # a step's scratch is metadata, never a buffer
    assert pool_bytes(pool).gpu_buffers == 0 and pool_bytes(pool).gpu_meta > b.gpu_meta
    fetch = Striped(world=world, rank=rank, buffer_slots=50, inner=inner)
    copies = pool_bytes(Pool(PoolConfig(EntrySpec(656), 3, fetch, 2, "meta"))).gpu_buffers
    assert copies == (50 + 1) * row  # the fetch mode's buffer (and its dummy row) on every rank
