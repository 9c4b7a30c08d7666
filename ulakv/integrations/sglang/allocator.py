"""A drop-in for SGLang's ``HiSparseTokenToKVPoolAllocator``: SGLang's paged allocator hands out
``loc`` (the logical slots of tokens, shared by prefix caching), and every ``loc`` it hands out or
frees is made live in, or released from, the ulakv pool of the KV pool it serves.

HiSparse's allocator also hands out device slots for prefill tokens and per-request buffers; here the
pool decides homes, so those calls have nothing to allocate. Live ``loc`` never exceed the pool's
capacity: the logical allocator's size is the pool's ``gpu_slots + cpu_slots``
(``size x host_to_device_ratio``), so the scheduler's ``available_size`` is exact and admission
never fails on the device.

Under ``--dcp-size D`` the ``loc`` space spans the DCP group, as SGLang's DCP allocator does: ``size
x ratio x D`` tokens in pages of ``page_size x D`` (the ``loc`` of one page are homed on the ranks in
turn), handed out from the second page, so ``loc`` run over the ``[0, (size x ratio + page_size) x
D)`` of ``DcpStoreConfig.address_space``. Every rank allocates alike and admits every ``loc``.

``install()`` puts :class:`UlakvAllocatorMixin` in front of SGLang's ``BaseTokenToKVPoolAllocator``;
SGLang's own classes are imported only when an allocator is built.
"""

from __future__ import annotations

from typing import Any

import torch

from . import dcp_hooks
from .coordinator import UnsupportedBySGLangAdapter
from .dcp_store import SGLangDcpStore
from .store import SGLangStore


class UlakvAllocatorMixin:
    """Mixed in front of ``BaseTokenToKVPoolAllocator`` by ``install()``
    (``UlakvTokenToKVPoolAllocator``)."""

    logical_attn_allocator: Any  # SGLang's paged allocator over [page_size, size_full + page_size)
    compress_ratio: int
    page_size: int

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kvcache: Any,
        need_sort: bool,
        host_to_device_ratio: int = 2,
    ) -> None:
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.platforms import current_platform

        dcp_size, _ = dcp_hooks.dcp_group()
        self._kvcache = kvcache
        self._size_full = size * host_to_device_ratio * dcp_size
        page_size *= dcp_size  # a DCP page: page_size loc a rank (SGLang's DCP allocator's)
        self.compress_ratio = 1
        self.dtype, self.device, self.page_size, self.need_sort = dtype, device, page_size, need_sort
        paged = current_platform.get_paged_allocator_cls() or PagedTokenToKVPoolAllocator
        self.logical_attn_allocator = paged(self._size_full, page_size, dtype, device, kvcache, need_sort)
        self.free_pages = self.release_pages = self.free_group = None
        self._spec_scratch_capacity = 0

    @property
    def store(self) -> SGLangStore | SGLangDcpStore:
        return self._kvcache.ulakv_store

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def size_full(self) -> int:
        return self._size_full

    @property
    def size(self) -> int:
        return self._size_full

    def available_size(self) -> int:
        return self.logical_attn_allocator.available_size()

    def get_kvcache(self) -> Any:
        return self._kvcache

    def configure_spec_scratch(self, capacity: int, *, device_buffer_size: int = 0) -> None:
        """HiSparse reserves device scratch for draft tokens; drafts here are ``loc`` like any other."""
        self._spec_scratch_capacity = capacity

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        """Extra tokens to keep free for a request beyond its own: none (no per-request buffer)."""
        return 0

    # -- allocation: SGLang's logical allocator, then the pool --------------------------------------
    def _live(self, loc: torch.Tensor | None) -> torch.Tensor | None:
        if loc is not None:
            self.store.admit(loc)
        return loc

    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self._live(self.logical_attn_allocator.alloc(need_size))

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        return self._live(
            self.logical_attn_allocator.alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
            )
        )

    def alloc_logical_only(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Every allocation is logical only here (the pool picks homes when rows are written)."""
        return self.alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens
        )

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        return self._live(self.logical_attn_allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc))

    def alloc_device_buffer(self, allocated_indices: torch.Tensor, need_size: int) -> torch.Tensor:
        raise UnsupportedBySGLangAdapter("ulakv keeps no per-request device buffer: the GPU cache is shared")

    def get_last_loc_compressed(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs

    def get_last_loc_hisparse_device(self, last_locs: torch.Tensor) -> torch.Tensor:
        return last_locs  # no separate device slot space

    # -- freeing -----------------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """``loc`` no request or cached prefix holds any more: back to SGLang's allocator, and out of
        the pool (their homes freed in every layer)."""
        if free_index.numel() == 0:
            return
        self.logical_attn_allocator.free(free_index)
        self.store.release(free_index)

    def free_hisparse(self, free_indices: torch.Tensor) -> None:
        """HiSparse frees device slots of ``loc`` here; ``free`` releases them from the pool."""

    def free_hisparse_indices(self, buffer_indices: torch.Tensor) -> None:
        """HiSparse frees per-request buffer slots here; there are none."""

    def free_group_begin(self) -> None:
        """Frees are immediate (as HiSparse's): the pool must learn of each at once."""

    def free_group_end(self) -> None:
        """See ``free_group_begin``."""

    def clear(self) -> None:
        self.logical_attn_allocator.clear()
        self.store.release_all()
