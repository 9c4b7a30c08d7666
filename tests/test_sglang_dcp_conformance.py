"""The DCP path's and the shared top-k's expectations of SGLang's source: met by the pinned wheel,
and each one named when a copy of the source is changed under it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools import sglang_dcp_conformance as dcp_conformance
from tools.sglang_wheel import wheel_source

FILES = sorted({e.module for e in dcp_conformance.EXPECTED} | {"sglang/srt/layers/attention/dsa_backend.py"})


@pytest.fixture(scope="module")
def pinned() -> Path:
    return wheel_source()


def test_the_pinned_wheel_meets_every_expectation(pinned: Path) -> None:
    assert dcp_conformance.problems(pinned) == []
    assert dcp_conformance.main(["--source", str(pinned)]) == 0


MUTATIONS = {
    "kernel-param-renamed": (
        "transform_index.py",
        "    dcp_rank: int,\n) -> tuple",
        "    rank: int,\n) -> tuple",
        "transform_index_page_table_dcp",
    ),
    "localize-gone": (
        "dsa_dcp.py",
        "def localize_dcp_page_table(",
        "def localize_dcp_page_table_v2(",
        "no localize_dcp_page_table",
    ),
    "top-k-lens-not-read": ("dsa_dcp.py", '"sparse_mla_top_k_lens"', '"top_k_lens"', "sparse_mla_top_k_lens"),
    "cache-field-gone": (
        "dsa_dcp.py",
        "    counts: Optional[torch.Tensor] = None\n",
        "",
        "DcpPageTableCache",
    ),
    "new-skip-rule": (
        "model_config.py",
        '    cli_factor = getattr(config, "cli_factor", 1)',
        '    cli_factor = getattr(config, "cli_factor", 1) + getattr(config, "new_rule", 0)',
        "new_rule",
    ),
    "call-site-keyword": ("dsa_backend.py", "dcp_rank=", "rank_of_dcp=", "rank_of_dcp"),
    "reuse-key-changed": (
        "dsa_dcp.py",
        "cache.topk_indices is topk_indices",
        "cache.topk_indices == topk_indices",
        "identity",
    ),
    "reuse-any-layer": (
        "dsa_dcp.py",
        "cache.layer_id == layer_id - 1",
        "cache.layer_id < layer_id",
        "layer_id - 1",
    ),
    "pool-param-gone": (
        "memory_pool.py",
        "        skip_topk_layers: Optional[List[bool]] = None,\n",
        "",
        "skip_topk_layers",
    ),
}


def mutated_copy(pinned: Path, into: Path, files: list[str], mutation: tuple[str, str, str, str]) -> Path:
    """``files`` of the pinned source copied under ``into``, the mutation's ``old`` text replaced by
    its ``new`` in the file named ``name``; returns ``into``."""
    name, old, new, _ = mutation
    for rel in files:
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pinned / rel, into / rel)
    target = next(into / rel for rel in files if rel.endswith("/" + name))
    text = target.read_text()
    assert old in text, f"{name}: the pinned source changed under the test"
    target.write_text(text.replace(old, new))
    return into


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_a_changed_source_is_named(case: str, pinned: Path, tmp_path: Path) -> None:
    said = MUTATIONS[case][3]
    found = dcp_conformance.problems(mutated_copy(pinned, tmp_path, FILES, MUTATIONS[case]))
    assert any(said in line for line in found), found
    assert dcp_conformance.main(["--source", str(tmp_path)]) == 1


# What ``dcp_hooks`` reads, beside the files above.
HOOK_FILES = sorted(
    {
        "sglang/srt/arg_groups/model_overrides/deepseek_v2.py",
        "sglang/srt/mem_cache/kv_cache_configurator.py",
        "sglang/srt/layers/attention/dsa_backend.py",
        "sglang/srt/layers/attention/dsa/dsa_dcp.py",
        "sglang/srt/model_executor/pool_configurator.py",
        "sglang/srt/runtime_context.py",
        "sglang/srt/arg_groups/fields/parallel.py",
        "sglang/srt/plugins/hook_registry.py",
        "sglang/srt/mem_cache/memory_pool.py",
        "sglang/kernels/ops/kvcache/mla_buffer.py",
    }
)

HOOK_MUTATIONS = {
    "overrides-renamed": (
        "deepseek_v2.py",
        "def _dsa_dcp_overrides(cfg",
        "def _dsa_dcp_overrides_v2(cfg",
        "no _dsa_dcp_overrides",
    ),
    "refusal-gone": (
        "deepseek_v2.py",
        'raise ValueError("DSA DCP does not support HiSparse or HiCache.")',
        "pass",
        "no longer refuses HiSparse",
    ),
    "is-prefill-dropped": ("dsa_backend.py", "                is_prefill=True,\n", "", "is_prefill="),
    "cache-attr-renamed": (
        "dsa_backend.py",
        "self._dcp_page_table_cache = DcpPageTableCache()",
        "self._dcp_cache = DcpPageTableCache()",
        "self._dcp_page_table_cache",
    ),
    "allocator-widened": (
        "kv_cache_configurator.py",
        "HiSparseTokenToKVPoolAllocator(\n                            sizes.max_total_num_tokens,",
        "HiSparseTokenToKVPoolAllocator(\n                            sizes.max_total_num_tokens * 2,",
        "widens it by dcp_size",
    ),
    "index-not-counted": (
        "pool_configurator.py",
        "indexer_cell_size *= dcp_size",
        "indexer_cell_size *= 1",
        "dcp_size times",
    ),
    "around-convention": (
        "hook_registry.py",
        "return hook(original_fn, *args, **kwargs)",
        "return hook(*args, original_fn=original_fn, **kwargs)",
        "hook(original_fn",
    ),
    "writer-not-widened": (
        "memory_pool.py",
        "            set_mla_kv_buffer_dcp_sharded_triton(\n                dst_buffer,",
        "            set_mla_kv_buffer_triton(\n                dst_buffer,",
        "widened ids",
    ),
    "groups-not-read": (
        "kv_cache_configurator.py",
        "self.layer_info.",
        "self.layers_info.",
        "self.layer_info.start_layer",
    ),
}


def test_the_pinned_wheel_meets_every_hook_expectation(pinned: Path) -> None:
    assert dcp_conformance.hook_problems(pinned) == []


@pytest.mark.parametrize("case", sorted(HOOK_MUTATIONS))
def test_a_changed_hook_target_is_named(case: str, pinned: Path, tmp_path: Path) -> None:
    said = HOOK_MUTATIONS[case][3]
    found = dcp_conformance.hook_problems(mutated_copy(pinned, tmp_path, HOOK_FILES, HOOK_MUTATIONS[case]))
    assert found and any(said in line for line in found), found
