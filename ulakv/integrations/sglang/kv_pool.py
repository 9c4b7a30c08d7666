"""A drop-in for SGLang's ``HiSparseDSATokenToKVPool``: the DSA KV pool whose MLA rows live in ulakv.

``install()`` puts :class:`UlakvKVPoolMixin` in front of SGLang's ``DSATokenToKVPool``, which keeps
everything else (the indexer's keys over the whole ``loc`` space, as HiSparse keeps them; dtypes;
the backend's metadata). What changes:

- ``kv_buffer[layer]`` is a view of the ulakv pool's GPU rows for the layer, ``[rows, 1,
  kv_cache_dim]`` with rows a multiple of 64 (FlashMLA's page); FlashMLA reads it with the slots the
  coordinator returns;
- ``set_mla_kv_buffer`` packs the rows with SGLang's own writer (fp8 quantisation, scales, rope),
  into a scratch tensor, and stores them as bytes through ``pool.write`` at their ``loc``;
- ``translate_loc_to_hisparse_device`` (prefill) makes a prompt's selected ``loc`` resident and
  returns their slots, for the layer whose buffer the backend fetched last (``get_key_buffer``, which
  ``forward_extend`` calls right before).

Under ``--dcp-size D`` (SGLang's DCP group, read when the pool is built) the store is a rank's
:class:`~.dcp_store.SGLangDcpStore`: ``size`` GPU slots and the rank's share of ``(size x ratio +
page_size) x D`` ``loc`` beneath them, and the indexer's key buffer spans that ``loc`` space, as
SGLang sizes it under DCP (its memory profile counts it so: ``indexer_cell_size *= dcp_size``).
Rows are written on every rank, each keeping those homed on it; the DSA backend localises page
tables through the store (``dcp_hooks``), so the HiSparse translations are refused there.

SGLang's own classes are imported only inside ``install()``; this module imports none.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import dcp_hooks
from .coordinator import UnsupportedBySGLangAdapter
from .dcp_store import DcpStoreConfig, SGLangDcpStore
from .layer_groups import group_starts_from_skips
from .store import SGLangStore, StoreConfig, policy_named


def _loc_of(loc_info: Any) -> torch.Tensor:
    """A ``KVWriteLoc``'s ``loc``, or a bare ``loc`` tensor (SGLang's ``unwrap_write_loc``)."""
    return loc_info.loc if hasattr(loc_info, "loc") else loc_info


class UlakvKVPoolMixin:
    """Mixed in front of ``DSATokenToKVPool`` by ``install()`` (``UlakvDSATokenToKVPool``)."""

    ulakv_store: SGLangStore | SGLangDcpStore
    kv_buffer: list[torch.Tensor]

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        dtype: torch.dtype,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        index_head_dim: int,
        enable_memory_saver: bool,
        kv_cache_dim: int,
        start_layer: int | None = None,
        end_layer: int | None = None,
        index_kpool: int = 1,
        index_kpool_compress: bool = False,
        tail_extra_slots: int = 0,
        max_running_requests: int | None = None,
        skip_topk_layers: list[bool] | None = None,
        host_to_device_ratio: int = 2,
    ) -> None:
        """HiSparse's arguments: ``size`` device tokens, ``size x host_to_device_ratio`` live ``loc``
        at most. The MLA rows become the ulakv pool's (``size`` GPU slots shared by every request,
        the rest on the CPU); ``ULAKV_SGLANG_POLICY`` (``lru``/``pblru``) picks the policy and
        ``ULAKV_SGLANG_MAX_BATCH`` (default ``max_running_requests``) bounds a step's batch.
        Each layer that computes a fresh top-k starts a layer group: from ``skip_topk_layers`` where
        SGLang passes it (only when it elides the reusing layers' index keys, never with
        ``--enable-hisparse``), else from the model's configuration (``dcp_hooks.MODEL_GROUP_STARTS``,
        set while SGLang builds this pool); with neither, every layer is a group."""
        dcp_size, dcp_rank = dcp_hooks.dcp_group()
        if dcp_size > 1:  # SGLang's DCP index buffer over the widened loc space
            index_buf_size = (size * host_to_device_ratio + page_size) * dcp_size - page_size
        else:
            index_buf_size = size * host_to_device_ratio
        super().__init__(  # type: ignore[call-arg]  # SGLang's DSATokenToKVPool
            size=size,
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            dtype=dtype,
            qk_rope_head_dim=qk_rope_head_dim,
            layer_num=layer_num,
            device=device,
            index_head_dim=index_head_dim,
            enable_memory_saver=enable_memory_saver,
            kv_cache_dim=kv_cache_dim,
            start_layer=start_layer,
            end_layer=end_layer,
            index_buf_size=index_buf_size,
            index_kpool=index_kpool,
            index_kpool_compress=index_kpool_compress,
            tail_extra_slots=tail_extra_slots,
            max_running_requests=max_running_requests,
            skip_topk_layers=skip_topk_layers,
        )
        store_dtype = self.kv_buffer[0].dtype
        policy = policy_named(os.environ.get("ULAKV_SGLANG_POLICY", "lru"))
        max_batch = int(os.environ.get("ULAKV_SGLANG_MAX_BATCH", max_running_requests or 256))
        max_queries = int(os.environ.get("ULAKV_SGLANG_MAX_QUERIES", 1))
        # Layers that reuse the previous layer's top-k join its group: prepared once a step.
        starts = dcp_hooks.MODEL_GROUP_STARTS.get()
        if skip_topk_layers is not None:
            starts = group_starts_from_skips(skip_topk_layers)
        if dcp_size > 1:
            self.ulakv_store = SGLangDcpStore(
                DcpStoreConfig(
                    layers=layer_num,
                    bytes_per_token=kv_cache_dim * store_dtype.itemsize,
                    device_tokens=size,
                    host_to_device_ratio=host_to_device_ratio,
                    dcp_size=dcp_size,
                    dcp_rank=dcp_rank,
                    page_size=page_size,
                    group_starts=starts,
                    max_batch=max_batch,
                    max_queries=max_queries,
                    policy=policy,
                    device=device,
                )
            )
        else:
            self.ulakv_store = SGLangStore(
                StoreConfig(
                    layers=layer_num,
                    bytes_per_token=kv_cache_dim * store_dtype.itemsize,
                    device_tokens=size,
                    logical_tokens=size * host_to_device_ratio,
                    page_size=page_size,
                    max_batch=max_batch,
                    max_queries=max_queries,
                    policy=policy,
                    device=device,
                    group_starts=starts,
                )
            )
        # SGLang's own rows are replaced by views of the pool's (its copy is freed here).
        self.kv_buffer = [self.ulakv_store.kv_rows(layer).view(store_dtype) for layer in range(layer_num)]
        if isinstance(getattr(self, "data_ptrs", None), torch.Tensor):  # read by SGLang's copy kernels
            ptrs = [buf.data_ptr() for buf in self.kv_buffer]
            self.data_ptrs = torch.tensor(ptrs, dtype=self.data_ptrs.dtype, device=self.data_ptrs.device)
        self._ulakv_layer = 0
        # How SGLang's row writer reads a write loc here (``_write_loc_dcp_span``): ids a stored row
        # spans, and this rank's residue.
        self._ulakv_write_span = (dcp_size, dcp_rank) if dcp_size > 1 else (1, 0)

    # -- the mapping HiSparse keeps; ulakv's is inside the pool ------------------------------------
    def register_mapping(self, full_to_hisparse_device_index_mapping: torch.Tensor) -> None:
        """HiSparse's allocator hands its ``loc`` -> device-slot table here. The ulakv allocator does
        not call it: where a ``loc`` lives is the pool's mapping, changed only by its kernels."""
        raise UnsupportedBySGLangAdapter("the ulakv pool keeps its own mapping; nothing registers one")

    def translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        """Prefill: slots of a ``[tokens, K]`` table of ``loc`` (0 / -1 padding) in the layer whose
        ``kv_buffer`` was fetched last, made resident now (``SGLangStore.prefill_slots``). Under DCP
        the backend localises instead (a rank's rows hold only the ``loc`` homed on it)."""
        store = self.ulakv_store
        if isinstance(store, SGLangDcpStore):
            raise UnsupportedBySGLangAdapter(
                "HiSparse's loc translation under --dcp-size > 1: a rank's rows hold only the loc homed "
                "on it, and SGLang's DCP attention (the trtllm DSA backend) localises page tables"
            )
        return store.prefill_slots(self._ulakv_layer, compressed_indices)

    def _translate_loc_to_hisparse_device(self, compressed_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_to_hisparse_device(compressed_indices)

    def translate_loc_from_full_to_hisparse_device(self, full_indices: torch.Tensor) -> torch.Tensor:
        return self.translate_loc_to_hisparse_device(full_indices)

    def translate_loc_from_full_to_compressed(self, full_indices: torch.Tensor) -> torch.Tensor:
        return full_indices

    # -- rows ------------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._ulakv_layer = layer_id
        return super().get_key_buffer(layer_id)  # type: ignore[misc]

    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """DSA writes MLA rows through ``set_mla_kv_buffer``; the plain path stores ``cache_k`` rows
        as they are (``[n, 1, kv_cache_dim]`` of the store dtype)."""
        loc = _loc_of(loc_info)
        rows = cache_k.reshape(loc.numel(), -1).contiguous().view(torch.uint8)
        self.ulakv_store.write(layer.layer_id, loc, rows)

    def set_mla_kv_buffer(
        self, layer: Any, loc_info: Any, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
    ) -> None:
        """Pack the new tokens' rows with SGLang's writer into scratch, then store them as bytes at
        their ``loc`` (new ones get a home; ``loc`` 0 is padding)."""
        loc = _loc_of(loc_info)
        n = loc.numel()
        # SGLang's writer never writes row 0 (its padding slot): pack into rows 1..n, store those.
        # Under DCP its writer takes widened ids (``s % D`` this rank's, stored at ``s // D``): row
        # ``i`` is id ``i x D + rank``, so every row lands in the scratch.
        buf = self.kv_buffer[0]
        scratch = torch.empty((n + 1, 1, buf.shape[-1]), dtype=buf.dtype, device=loc.device)
        span, rank = self._ulakv_write_span
        rows = torch.arange(1, n + 1, dtype=loc.dtype, device=loc.device) * span + rank
        self._write_mla_kv_buffer(scratch, rows, cache_k_nope, cache_k_rope)  # type: ignore[attr-defined]
        self.ulakv_store.write(layer.layer_id, loc, scratch[1:].reshape(n, -1).view(torch.uint8))

    def get_mla_kv_buffer(self, layer: Any, loc: torch.Tensor, dst_dtype: torch.dtype | None = None) -> Any:
        """Rows of ``loc`` read through their slots after making them resident (a prefill path)."""
        self._ulakv_layer = layer.layer_id
        slots = self.translate_loc_to_hisparse_device(loc.view(1, -1)).view(-1)
        return super().get_mla_kv_buffer(layer, slots, dst_dtype)  # type: ignore[misc]

    def transfer_values_on_device(self, dst_indices: torch.Tensor, src_indices: torch.Tensor) -> None:
        """HiSparse copies rows between device slots when speculative decoding rotates its scratch;
        ulakv moves rows only inside its own plans."""
        raise UnsupportedBySGLangAdapter("the ulakv pool moves rows only inside its plans")

    def get_cpu_copy(self, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None) -> Any:
        raise UnsupportedBySGLangAdapter("the ulakv pool does not support get_cpu_copy (as HiSparse's)")

    def load_cpu_copy(
        self, kv_cache_cpu: Any, indices: Any, mamba_indices: Any = None, req_pool_index: Any = None
    ) -> Any:
        raise UnsupportedBySGLangAdapter("the ulakv pool does not support load_cpu_copy (as HiSparse's)")
