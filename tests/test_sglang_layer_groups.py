"""Layer groups from a model's configuration, against SGLang's own ``dsa_layer_skips_topk`` (its
source read from the pinned wheel and run alone), and pools over such groups."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

import ulakv
from tools.sglang_wheel import wheel_source
from ulakv import PBLRU, EntrySpec, ExactLRU, PoolConfig, Tiered
from ulakv.errors import ConfigError, InvalidInputError
from ulakv.integrations.sglang.layer_groups import (
    group_starts_from_config,
    group_starts_from_skips,
    skips_topk,
)


@pytest.fixture(scope="module")
def sglang_skips_topk():
    """SGLang 0.5.23's ``dsa_layer_skips_topk``, compiled from the wheel's source on its own."""
    path = wheel_source() / "sglang/srt/configs/model_config.py"
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "dsa_layer_skips_topk"]
    assert found, f"dsa_layer_skips_topk not in {path}"
    module = ast.Module(body=found, type_ignores=[])
    scope = {"is_deepseek_dsa": lambda config: True, "PretrainedConfig": object}
    exec(compile(module, str(path), "exec"), scope)
    return scope["dsa_layer_skips_topk"]


CONFIGS = {
    "deepseek-v3.2": SimpleNamespace(),  # a fresh top-k every layer
    "glm-5.3": SimpleNamespace(index_topk_freq=4, index_skip_topk_offset=3),
    "freq-3-no-offset": SimpleNamespace(index_topk_freq=3),
    "longcat-cli-2": SimpleNamespace(cli_factor=2),
    "pattern": SimpleNamespace(index_topk_pattern="FFSSFSF"),
    "indexer-types": SimpleNamespace(indexer_types=["full", "shared", "shared", "full", "shared"]),
    "none-values": SimpleNamespace(cli_factor=None, index_topk_freq=None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_skips_equal_sglang(name, sglang_skips_topk) -> None:
    config = CONFIGS[name]
    for layer in range(80):
        assert skips_topk(config, layer) == sglang_skips_topk(config, layer), (name, layer)


def test_glm_5_3_has_21_groups_of_78_layers() -> None:
    starts = group_starts_from_config(CONFIGS["glm-5.3"], 0, 78)
    assert len(starts) == 21 and starts[:4] == (0, 1, 2, 6) and starts[-1] == 74
    cfg = PoolConfig(
        entry=EntrySpec(8), num_layers=78, group_starts=starts, layout=Tiered(gpu_slots=4, cpu_slots=4)
    )
    assert cfg.num_groups == 21 and cfg.max_group_layers == 4
    assert [len(cfg.group_layers(g)) for g in range(21)] == [1, 1, 4] + [4] * 17 + [4]
    assert all(cfg.group_of(layer) == g for g in range(21) for layer in cfg.group_layers(g))


def test_bad_group_starts_are_config_errors() -> None:
    base = dict(entry=EntrySpec(8), num_layers=6, layout=Tiered(gpu_slots=4))
    for bad in ((), (1, 3), (0, 3, 3), (0, 6), [0, 2], (0, True)):
        with pytest.raises(ConfigError, match="group_starts"):
            PoolConfig(**base, group_starts=bad)
    with pytest.raises(ConfigError, match="not both"):
        PoolConfig(**base, group_starts=(0, 2), layers_per_group=2)
    with pytest.raises(InvalidInputError, match="no layers"):
        group_starts_from_skips([])


def test_a_pipeline_stage_that_begins_on_a_reusing_layer_starts_a_group() -> None:
    """GLM-5.3's second stage of two (layers 39-77) begins on a layer that reuses a top-k: its own
    pool prepares it, so it starts a group; the stage's other groups are the model's."""
    config = CONFIGS["glm-5.3"]
    assert skips_topk(config, 39)
    starts = group_starts_from_config(config, 39, 78)
    whole = group_starts_from_config(config, 0, 78)
    assert starts[0] == 0 and starts[1:] == tuple(s - 39 for s in whole if s > 39)


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(4)], ids=["exact_lru", "pblru4"])
def test_a_pool_over_irregular_groups_reads_back_every_layer(policy) -> None:
    """Groups of 1, 3 and 2 layers (starts 0, 1, 4): each group's prepare serves all its layers, the
    rows read through its slots are the rows written, layer by layer, while the GPU evicts."""
    gen = torch.Generator().manual_seed(2)
    layers, width = 6, 12
    cfg = PoolConfig(
        entry=EntrySpec(width),
        num_layers=layers,
        group_starts=(0, 1, 4),
        layout=Tiered(gpu_slots=6, cpu_slots=40, policy=policy),
    )
    pool = ulakv.Pool(cfg)
    seq = pool.admit(29)
    addrs = seq.addresses
    kv = torch.randint(0, 256, (layers, 29, width), dtype=torch.uint8, generator=gen)
    for layer in range(layers):
        pool.write(layer, addrs, kv[layer])
    for _ in range(8):
        picks = torch.randperm(29, generator=gen)[:5]
        for group in range(cfg.num_groups):
            slots = pool.prepare(group, addrs[picks].view(1, 5)).slots.view(-1).long()
            for layer in cfg.group_layers(group):
                assert torch.equal(pool.gpu_buffer(layer)[slots], kv[layer, picks])
        pool.check_invariants()
    assert pool.stats()["victims"] > 0


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(4)], ids=["exact_lru", "pblru4"])
def test_a_shared_top_k_group_moves_the_same_bytes_in_fewer_plans(policy) -> None:
    """Layers that share a top-k, as one group (prepared once a step) and as one group a layer
    (each prepared with the same selection): the steps move the same rows, in half the plans and
    launches. (Writing a group layer by layer costs more: a new entry's first layer also writes
    zero rows for the group's other layers; ``benchmarks/RESULTS.md``, "Write copies".)"""
    gen = torch.Generator().manual_seed(4)
    layers, width, tokens = 4, 12, 41
    kv = torch.randint(0, 256, (layers, tokens, width), dtype=torch.uint8, generator=gen)
    steps = [torch.randperm(tokens, generator=gen)[:6] for _ in range(10)]
    found = {}
    for name, starts in (("shared", (0, 2)), ("apart", (0, 1, 2, 3))):
        cfg = PoolConfig(
            entry=EntrySpec(width),
            num_layers=layers,
            group_starts=starts,
            layout=Tiered(gpu_slots=8, cpu_slots=40, policy=policy),
        )
        pool = ulakv.Pool(cfg)
        addrs = pool.admit(tokens).addresses
        for layer in range(layers):
            pool.write(layer, addrs, kv[layer])
        before = pool.stats()
        plans = 0
        for picks in steps:
            for layer in range(layers):
                group = cfg.group_of(layer)
                if layer == cfg.group_layers(group).start:
                    slots = pool.prepare(group, addrs[picks].view(1, -1)).slots.view(-1).long()
                    plans += 1
                assert torch.equal(pool.gpu_buffer(layer)[slots], kv[layer, picks])
        stats = pool.stats()
        found[name] = (*(stats[k] - before[k] for k in ("bytes_in", "bytes_out", "launches")), plans)
    shared, apart = found["shared"], found["apart"]
    assert shared[:2] == apart[:2] and shared[0] > 0
    assert 2 * shared[2] == apart[2] and 2 * shared[3] == apart[3]  # launches, plans
