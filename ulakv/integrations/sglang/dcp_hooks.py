"""SGLang's decode context parallelism on ulakv: what ``install()`` hooks for ``--enable-hisparse
--dcp-size N``.

SGLang 0.5.23 refuses HiSparse with DCP (``_dsa_dcp_overrides``: "DSA DCP does not support HiSparse
or HiCache"). Under the adapter the combination means: each rank's KV pool is an
:class:`~.dcp_store.SGLangDcpStore` (its GPU cache and an exclusive CPU tier over the rank's share
of the ``loc`` space), the allocator hands out ``loc`` over the whole DCP group, and the page table
SGLang's DCP attention reads is the store's localisation in place of
``transform_index_page_table_dcp``. The hooks, each a pass-through unless that pool is present:

- :func:`dsa_dcp_overrides` (around ``_dsa_dcp_overrides``): lifts the refusal, refuses at start-up
  what the adapter does not serve (naming the flag), and keeps SGLang's other DCP rules;
- :func:`record_model_groups` (around ``KVCacheConfigurator._build_dsa_kv_pool``): the model's
  shared-top-k layer groups for the KV pool being built (SGLang passes ``skip_topk_layers`` only
  when it elides the reusing layers' index keys, never with HiSparse);
- :func:`attach_dcp_store` (after ``DeepseekSparseAttnBackend.__init__``): the backend's
  ``DcpPageTableCache`` becomes a :class:`UlakvDcpPageTable` over the rank's store;
- :func:`mark_prefill` (around ``_forward_trtllm``): whether the call is a prefill, whose
  localisation raises its refusal at once;
- :func:`localize_dcp_page_table` (around SGLang's): the store's localisation.

``dcp_conformance.py`` holds every name, parameter and call site used here to the pinned wheel.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch

from ...errors import UlakvError
from .coordinator import UnsupportedBySGLangAdapter
from .dcp_store import SGLangDcpStore
from .layer_groups import group_starts_from_config

#: The model's layer groups while SGLang builds its DSA KV pool (``record_model_groups``).
MODEL_GROUP_STARTS: ContextVar[tuple[int, ...] | None] = ContextVar("ulakv_model_group_starts", default=None)

#: SGLang's DCP attention: the trtllm DSA backend (``_forward_trtllm`` localises; no other does).
DCP_BACKEND = "trtllm"


def dcp_group() -> tuple[int, int]:
    """``(attn_dcp_size, attn_dcp_rank)`` of this process, from SGLang's runtime context."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return int(parallel.attn_dcp_size), int(parallel.attn_dcp_rank)


# -- start-up: server arguments ---------------------------------------------------------------------
class _WithoutHiSparse:
    """A view of SGLang's resolving config with ``enable_hisparse`` read as False: SGLang's own DCP
    rules (PD disaggregation, ``--speculative-eagle-topk``, the trtllm default) still apply."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg

    enable_hisparse = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def refuse_unserved_dcp(cfg: Any) -> None:
    """Raise ``UnsupportedBySGLangAdapter`` naming the flag when ``--enable-hisparse --dcp-size > 1``
    comes with something the adapter does not serve under DCP."""
    if cfg.enable_hierarchical_cache:
        raise UnsupportedBySGLangAdapter(
            "--enable-hierarchical-cache with --enable-hisparse --dcp-size > 1: ulakv's CPU tier is "
            "the host tier here; HiCache's host pool has no DCP translation for HiSparse"
        )
    for field in ("dsa_prefill_backend", "dsa_decode_backend"):
        value = getattr(cfg, field)
        if value is not None and value != DCP_BACKEND:
            flag = "--" + field.replace("_", "-")
            raise UnsupportedBySGLangAdapter(
                f"{flag} {value!r} with --enable-hisparse --dcp-size > 1: SGLang's DCP attention is "
                f"the {DCP_BACKEND!r} DSA backend (the only one that localises page tables); "
                f"leave {flag} unset or pass {DCP_BACKEND!r}"
            )


def dsa_dcp_overrides(original: Any, cfg: Any) -> dict:
    """Around SGLang's ``_dsa_dcp_overrides(cfg)``: with ``--enable-hisparse`` under DCP, the
    adapter's refusals, then SGLang's rules as if HiSparse were off; otherwise SGLang's alone."""
    if cfg.dcp_size <= 1 or not cfg.enable_hisparse:
        return original(cfg)
    refuse_unserved_dcp(cfg)
    overrides = dict(original(_WithoutHiSparse(cfg)))
    for field in ("dsa_prefill_backend", "dsa_decode_backend"):
        if getattr(cfg, field) is None:  # before HiSparse's own default (flashmla) can claim it
            overrides[field] = DCP_BACKEND
    return overrides


# -- start-up: the KV pool ---------------------------------------------------------------------------
def record_model_groups(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``KVCacheConfigurator._build_dsa_kv_pool``: the pool built inside sees the model's
    layer groups (``MODEL_GROUP_STARTS``) for the layers this rank holds."""
    info = configurator.layer_info
    starts = group_starts_from_config(configurator.model_config.hf_config, info.start_layer, info.end_layer)
    token = MODEL_GROUP_STARTS.set(starts)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        MODEL_GROUP_STARTS.reset(token)


# -- the attention backend -----------------------------------------------------------------------------
class UlakvDcpPageTable:
    """Stands in for a DSA backend's ``DcpPageTableCache`` when its KV pool is an
    :class:`SGLangDcpStore`: the localisations are the store's (which reuses one across the layers
    of a shared top-k, by SGLang's key). ``prefill`` is set per attention call (``mark_prefill``)."""

    def __init__(self, store: SGLangDcpStore) -> None:
        self.store = store
        self.prefill = False

    def localize(
        self,
        *,
        metadata: object,
        layer_id: int,
        topk_indices: torch.Tensor | None,
        page_table: torch.Tensor,
        dcp_size: int,
        dcp_rank: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.store.config
        if (dcp_size, dcp_rank) != (cfg.dcp_size, cfg.dcp_rank):
            raise UlakvError(
                f"localize_dcp_page_table: the backend's DCP rank {dcp_rank} of {dcp_size} is not the "
                f"pool's ({cfg.dcp_rank} of {cfg.dcp_size})"
            )
        capturing = self.store.pool.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.prefill and not capturing:
            return self.store.prefill_localize(
                layer_id, page_table, metadata=metadata, topk_indices=topk_indices
            )
        return self.store.localize(layer_id, page_table, metadata=metadata, topk_indices=topk_indices)


def attach_dcp_store(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """After ``DeepseekSparseAttnBackend.__init__``: a backend over a ulakv DCP pool localises
    through it (a draft model's backend, over SGLang's own pool, is left alone)."""
    store = getattr(backend.token_to_kv_pool, "ulakv_store", None)
    if isinstance(store, SGLangDcpStore):
        backend._dcp_page_table_cache = UlakvDcpPageTable(store)


def mark_prefill(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``_forward_trtllm(q, k, v, layer, forward_batch, ..., is_prefill=)``: an extend that is
    not a speculative verify (verify is captured like decode) localises as a prefill."""
    cache = getattr(backend, "_dcp_page_table_cache", None)
    if isinstance(cache, UlakvDcpPageTable):
        forward_batch = args[4] if len(args) > 4 else kwargs["forward_batch"]
        cache.prefill = (
            bool(kwargs.get("is_prefill", False)) and not forward_batch.forward_mode.is_target_verify()
        )
    return original(backend, *args, **kwargs)


def localize_dcp_page_table(original: Any, cache: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Around SGLang's ``localize_dcp_page_table(cache, *, metadata, layer_id, topk_indices,
    page_table, dcp_size, dcp_rank)``: the ulakv store's localisation where the backend has one."""
    if isinstance(cache, UlakvDcpPageTable):
        return cache.localize(**kwargs)
    return original(cache, **kwargs)


#: What ``install()`` registers, as SGLang's dotted target -> (hook type name, hook).
DCP_HOOKS: dict[str, tuple[str, Any]] = {
    "sglang.srt.arg_groups.model_overrides.deepseek_v2._dsa_dcp_overrides": ("AROUND", dsa_dcp_overrides),
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_dsa_kv_pool": (
        "AROUND",
        record_model_groups,
    ),
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend.__init__": ("AFTER", attach_dcp_store),
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._forward_trtllm": (
        "AROUND",
        mark_prefill,
    ),
    "sglang.srt.layers.attention.dsa.dsa_dcp.localize_dcp_page_table": ("AROUND", localize_dcp_page_table),
}
