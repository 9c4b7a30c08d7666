"""The hooks ``install()`` registers for ``--enable-hisparse --dcp-size``, composed by SGLang's own hook
registry (the pinned wheel's ``hook_registry.py``, loaded by path) around SGLang's own functions
where they load without SGLang's runtime (``_dsa_dcp_overrides``, ``localize_dcp_page_table``,
compiled from the wheel's source), and around stand-ins shaped as the conformance check pins them
where they do not (the backend, the KV cache configurator)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from tools.sglang_wheel import load_transform_index, wheel_source
from ulakv import CapacityError, UlakvError
from ulakv.integrations.sglang import dcp_hooks
from ulakv.integrations.sglang.allocator import UlakvAllocatorMixin
from ulakv.integrations.sglang.coordinator import UlakvSparseCoordinator, UnsupportedBySGLangAdapter
from ulakv.integrations.sglang.dcp import sglang_dcp_reference
from ulakv.integrations.sglang.dcp_store import DcpStoreConfig, SGLangDcpStore
from ulakv.integrations.sglang.layer_groups import group_starts_from_config

BYTES = 16


@pytest.fixture(scope="module")
def source() -> Path:
    return wheel_source()


@pytest.fixture(scope="module")
def registry(source: Path) -> ModuleType:
    """SGLang's ``hook_registry`` (standard library imports only)."""
    path = source / "sglang/srt/plugins/hook_registry.py"
    spec = importlib.util.spec_from_file_location("sglang_hook_registry_pinned", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sglang_function(source: Path, module: str, name: str, namespace: dict) -> object:
    """One top-level function (or class) of SGLang's source, compiled alone into ``namespace``."""
    tree = ast.parse((source / module).read_text(encoding="utf-8"))
    node = next(n for n in tree.body if getattr(n, "name", None) == name)
    exec(compile(ast.Module([node], type_ignores=[]), str(source / module), "exec"), namespace)
    return namespace[name]


def around(registry: ModuleType, original: object, hook: object) -> object:
    return registry._wrap_fn(original, hook, registry.HookType.AROUND)


def _cfg(**over) -> SimpleNamespace:
    base = dict(
        dcp_size=2,
        enable_hisparse=True,
        enable_hierarchical_cache=False,
        disaggregation_mode="null",
        speculative_eagle_topk=None,
        dsa_prefill_backend=None,
        dsa_decode_backend=None,
        dcp_replicate_q_proj=None,
        dcp_comm_backend="ag_rs",
    )
    base.update(over)
    return SimpleNamespace(**base)


# -- server arguments --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def overrides(source: Path, registry: ModuleType):
    original = _sglang_function(
        source, "sglang/srt/arg_groups/model_overrides/deepseek_v2.py", "_dsa_dcp_overrides", {}
    )
    return original, around(registry, original, dcp_hooks.dsa_dcp_overrides)


def test_hisparse_under_dcp_is_lifted_with_sglangs_dcp_defaults(overrides) -> None:
    original, hooked = overrides
    with pytest.raises(ValueError, match="HiSparse"):
        original(_cfg())  # SGLang alone refuses it
    assert hooked(_cfg()) == {"dsa_prefill_backend": "trtllm", "dsa_decode_backend": "trtllm"}
    assert hooked(_cfg(dsa_decode_backend="trtllm")) == {"dsa_prefill_backend": "trtllm"}
    assert hooked(_cfg(dcp_comm_backend="a2a"))["dcp_replicate_q_proj"] is True  # SGLang's rule kept
    assert hooked(_cfg(dcp_size=1)) == original(_cfg(dcp_size=1)) == {}
    assert hooked(_cfg(enable_hisparse=False)) == original(_cfg(enable_hisparse=False))


@pytest.mark.parametrize(
    ("over", "error", "words"),
    [
        ({"enable_hierarchical_cache": True}, UnsupportedBySGLangAdapter, "--enable-hierarchical-cache"),
        ({"dsa_decode_backend": "flashmla_sparse"}, UnsupportedBySGLangAdapter, "--dsa-decode-backend"),
        ({"dsa_prefill_backend": "flashmla_kv"}, UnsupportedBySGLangAdapter, "--dsa-prefill-backend"),
        ({"disaggregation_mode": "decode"}, ValueError, "PD disaggregation"),  # SGLang's own
        ({"speculative_eagle_topk": 4}, ValueError, "speculative-eagle-topk"),  # SGLang's own
    ],
    ids=["hicache", "decode-backend", "prefill-backend", "pd-disaggregation", "eagle-topk"],
)
def test_what_is_not_served_is_refused_at_start_up_by_flag(overrides, over, error, words) -> None:
    _, hooked = overrides
    with pytest.raises(error, match=words):
        hooked(_cfg(**over))


# -- the KV pool's layer groups ---------------------------------------------------------------------
def test_the_pool_built_inside_sees_the_models_groups(registry: ModuleType) -> None:
    glm = SimpleNamespace(index_topk_freq=4, index_skip_topk_offset=3)  # GLM-5.3's rule
    seen = []

    def build(configurator, *, max_total_num_tokens: int) -> str:
        seen.append(dcp_hooks.MODEL_GROUP_STARTS.get())
        return "pool"

    configurator = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=glm), layer_info=SimpleNamespace(start_layer=10, end_layer=30)
    )
    hooked = around(registry, build, dcp_hooks.record_model_groups)
    assert hooked(configurator, max_total_num_tokens=64) == "pool"
    assert seen == [group_starts_from_config(glm, 10, 30)]
    assert seen[0][0] == 0 and 1 < len(seen[0]) < 20  # a stage's first layer starts a group; most reuse
    assert dcp_hooks.MODEL_GROUP_STARTS.get() is None  # only while SGLang builds the pool


# -- the attention backend ----------------------------------------------------------------------------
def _store(
    rank: int, world: int = 2, device_tokens: int = 16, validate: bool | None = None
) -> SGLangDcpStore:
    return SGLangDcpStore(
        DcpStoreConfig(
            layers=2,
            bytes_per_token=BYTES,
            device_tokens=device_tokens,
            host_to_device_ratio=2,
            dcp_size=world,
            dcp_rank=rank,
            page_size=8,
            validate=validate,
        )
    )


def _rows(loc: torch.Tensor, layer: int) -> torch.Tensor:
    return ((loc.long()[:, None] * 31 + layer * 7 + torch.arange(BYTES)) % 251).to(torch.uint8)


@pytest.fixture(scope="module")
def localize(source: Path, registry: ModuleType):
    """SGLang's ``localize_dcp_page_table`` over its own kernel, and the same with the hook around."""
    kernel = load_transform_index(source).transform_index_page_table_dcp
    namespace = {"transform_index_page_table_dcp": kernel, "Optional": object, "torch": torch}
    module = "sglang/srt/layers/attention/dsa/dsa_dcp.py"
    original = _sglang_function(source, module, "localize_dcp_page_table", namespace)
    return original, around(registry, original, dcp_hooks.localize_dcp_page_table)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_backend_over_a_ulakv_pool_localises_through_it(localize, rank: int) -> None:
    original, hooked = localize
    world, store = 2, _store(rank)
    loc = torch.arange(16, 16 + 40, dtype=torch.int32)  # loc from the second DCP page (8 x 2)
    store.admit(loc)
    for layer in range(2):
        store.write(layer, loc, _rows(loc, layer))
    g = torch.Generator().manual_seed(rank)
    page_table = loc[torch.randint(0, 40, (3, 9), generator=g)]
    page_table[1, 4:] = -1  # padding
    cache = dcp_hooks.UlakvDcpPageTable(store)
    metadata = object()
    keys = dict(
        metadata=metadata, topk_indices=page_table, page_table=page_table, dcp_size=world, dcp_rank=rank
    )
    for layer in range(2):
        block_table, counts = hooked(cache, layer_id=layer, **keys)
        _, want_counts = sglang_dcp_reference(page_table, world, rank)
        assert torch.equal(counts, want_counts)
        mine = page_table.where((page_table >= 0) & (page_table % world == rank), -1)
        for r in range(3):
            got = store.kv_rows(layer)[block_table[r, : counts[r]].long(), 0]
            want = _rows(mine[r][mine[r] >= 0], layer)
            assert torch.equal(got, want)
        assert (block_table[:, counts.max() :] == -1).all()
    # SGLang's cache object takes SGLang's path, untouched.
    sglang_cache = SimpleNamespace(
        metadata=None, layer_id=-1, topk_indices=None, page_table=None, counts=None
    )
    table, counts = hooked(sglang_cache, layer_id=0, **keys)
    assert torch.equal(table, original(sglang_cache, layer_id=0, **keys)[0])
    assert torch.equal(table, sglang_dcp_reference(page_table, world, rank)[0])
    with pytest.raises(UlakvError, match="DCP rank"):
        hooked(cache, layer_id=0, **{**keys, "dcp_rank": 1 - rank})


def test_a_prefill_refusal_is_raised_at_once_a_decode_one_later(localize) -> None:
    _, hooked = localize
    store = _store(0, device_tokens=8, validate=False)  # as on a GPU: refusals reported, not raised
    loc = torch.arange(16, store.config.address_space, dtype=torch.int32)
    store.admit(loc)
    store.write(0, loc, _rows(loc, 0))
    too_many = loc.view(1, -1)  # 16 homed on rank 0, for 8 GPU slots
    cache = dcp_hooks.UlakvDcpPageTable(store)
    keys = dict(metadata=object(), topk_indices=None, page_table=too_many, dcp_size=2, dcp_rank=0)
    cache.prefill = True
    with pytest.raises(CapacityError):
        hooked(cache, layer_id=0, **keys)
    cache.prefill = False
    table, _ = hooked(cache, layer_id=0, **{**keys, "metadata": object()})  # captured decode: no sync
    assert (table == -1).all()  # refused: padding only, never another row
    with pytest.raises(CapacityError):
        store.pool.check()


def test_the_backend_attaches_the_store_and_marks_prefills(registry: ModuleType) -> None:
    store = _store(1)
    seen = []

    class Backend:  # DeepseekSparseAttnBackend as the conformance check pins it
        def __init__(self, model_runner) -> None:
            self.token_to_kv_pool = model_runner.token_to_kv_pool
            self._dcp_page_table_cache = "sglang's"

        def _forward_trtllm(self, q, k, v, layer, forward_batch, seq_lens, *rest, is_prefill=False):
            seen.append(self._dcp_page_table_cache.prefill)

    Backend.__init__ = registry._wrap_fn(
        Backend.__init__, dcp_hooks.attach_dcp_store, registry.HookType.AFTER
    )
    Backend._forward_trtllm = around(registry, Backend._forward_trtllm, dcp_hooks.mark_prefill)
    backend = Backend(SimpleNamespace(token_to_kv_pool=SimpleNamespace(ulakv_store=store)))
    assert isinstance(backend._dcp_page_table_cache, dcp_hooks.UlakvDcpPageTable)
    assert backend._dcp_page_table_cache.store is store
    mode = SimpleNamespace(verify=False, is_target_verify=lambda: mode.verify)
    batch = SimpleNamespace(forward_mode=mode)
    backend._forward_trtllm(0, 0, 0, None, batch, None, is_prefill=True)
    backend._forward_trtllm(0, 0, 0, None, batch, None)
    mode.verify = True  # a speculative verify: captured like decode
    backend._forward_trtllm(0, 0, 0, None, batch, None, is_prefill=True)
    assert seen == [True, False, False]
    draft = Backend(SimpleNamespace(token_to_kv_pool=SimpleNamespace()))  # SGLang's own pool
    assert draft._dcp_page_table_cache == "sglang's"


# -- the allocator and the coordinator ------------------------------------------------------------------
class _PagedAllocator:
    """SGLang's paged allocator as the ulakv allocator uses it: ``size`` tokens in pages of
    ``page_size``, pages handed out from the second."""

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort) -> None:
        self.size, self.page_size = size, page_size
        self.free_pages = list(range(1, size // page_size + 1))

    def alloc(self, need: int) -> torch.Tensor | None:
        pages = -(-need // self.page_size)
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        loc = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in taken])
        return loc[:need]

    def free(self, loc: torch.Tensor) -> None:
        self.free_pages += sorted({int(x) // self.page_size for x in loc})

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size


@pytest.fixture
def sglang_runtime(monkeypatch):
    """The two SGLang modules the allocator imports, and a DCP group of 2 (rank 1)."""
    paged = ModuleType("sglang.srt.mem_cache.allocator.paged")
    paged.PagedTokenToKVPoolAllocator = _PagedAllocator
    platforms = ModuleType("sglang.srt.platforms")
    platforms.current_platform = SimpleNamespace(get_paged_allocator_cls=lambda: None)
    monkeypatch.setitem(sys.modules, paged.__name__, paged)
    monkeypatch.setitem(sys.modules, platforms.__name__, platforms)
    monkeypatch.setattr(dcp_hooks, "dcp_group", lambda: (2, 1))


def test_the_allocator_spans_the_dcp_groups_loc_space(sglang_runtime) -> None:
    store = _store(1)
    kvcache = SimpleNamespace(ulakv_store=store)
    allocator = UlakvAllocatorMixin(
        16, 8, torch.int32, torch.device("cpu"), kvcache, False, host_to_device_ratio=2
    )
    assert allocator.size == store.config.logical_tokens == 16 * 2 * 2
    assert allocator.page_size == 8 * 2  # a DCP page: 8 loc a rank
    loc = allocator.alloc(allocator.available_size())  # every loc the group holds at once
    assert loc.min() == 8 * 2 and loc.max() == store.config.address_space - 1
    store.pool.check()  # every one admitted on this rank's books
    assert store.pool.live_addresses().numel() == loc.numel()
    allocator.free(loc[:10])
    assert store.pool.live_addresses().numel() == loc.numel() - 10
    store.release_all()  # SGLang's clear
    assert store.pool.live_addresses().numel() == 0


def test_the_coordinator_keeps_the_lifecycle_and_refuses_swap_in() -> None:
    store = _store(0)
    allocator = SimpleNamespace(get_kvcache=lambda: SimpleNamespace(ulakv_store=store))
    req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros((4, 64), dtype=torch.int32))
    coordinator = UlakvSparseCoordinator(req_to_token_pool, allocator, 7, 0, "cpu", None, num_draft_tokens=3)
    assert coordinator.device_buffer_size == 16
    request = SimpleNamespace()
    coordinator.admit_request_into_staging(request)
    assert coordinator.collect_ready_reqs() == [request]
    coordinator.request_finished(request)
    stats = coordinator.get_token_stats()
    assert stats[0] == 0
    with pytest.raises(UnsupportedBySGLangAdapter, match="--dsa-decode-backend"):
        coordinator.swap_in_selected_pages(torch.zeros(1), torch.zeros(1), torch.zeros((1, 7)), 0)
