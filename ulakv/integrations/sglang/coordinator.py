"""A drop-in for SGLang's ``HiSparseCoordinator``: ulakv's shared GPU cache instead of per-request
device buffers backed by a full CPU copy.

SGLang's DSA backend, when a coordinator is set, asks it per layer for the slots of the top-k
positions its indexer chose (``swap_in_selected_pages``) and runs FlashMLA's sparse kernels over the
layer's ``kv_buffer`` with them. Here that is: SGLang's own ``transform_index_page_table_decode``
turns each request's top-k positions into its token slots (``loc``) through ``req_to_token``; then
``SparseKV.prepare`` makes them GPU-resident in the layer's group and returns their rows in the
layer's ``kv_buffer`` (int32, -1 padding): no host sync, fixed buffers, capturable.

What HiSparse needs and ulakv does not:

- staging a prefill's KV from device to host, then a per-request device buffer: ulakv's entries are
  written once, where the pool puts them; a request is ready to decode as soon as its prefill ends
  (``admit_request_into_staging`` queues it, ``collect_ready_reqs`` hands it over the next round);
- a reserved device slot for the newest token (``map_last_loc_to_buffer``): its write gives it a home;
- freeing at ``request_finished``: slots belong to SGLang's allocator, which frees them (and so
  releases them here) when no request or cached prefix holds them; a shared prefix is one entry.

Under ``--dcp-size N`` the KV pool is an ``SGLangDcpStore`` and the DSA backend localises page
tables itself (``dcp_hooks``): the coordinator keeps the request lifecycle, and
``swap_in_selected_pages``, which only backends other than SGLang's DCP one call, is refused.

Not supported (raise ``UnsupportedBySGLangAdapter``): prefill/decode disaggregation's direct-to-host
admission (``admit_request_direct`` and the host-pool attributes it reads), DeepSeek-V4's compressed
HiSparse, and MiniMax-M3's block swap-in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ...errors import UlakvError
from .dcp_store import SGLangDcpStore
from .store import SGLangStore

Transform = Callable[..., torch.Tensor]


class UnsupportedBySGLangAdapter(UlakvError, NotImplementedError):
    """An SGLang feature the ulakv adapter does not serve. A ``NotImplementedError`` too, the type
    SGLang's own pools raise for what they do not serve (HiSparse's ``get_cpu_copy``), so SGLang
    code that expects that type handles ours alike."""


class Admitted(NamedTuple):
    """An entry of ``ack_staging_queue``: SGLang reads ``.req`` of each."""

    req: Any


class TokenStats(NamedTuple):
    """The fields of SGLang's ``HiSparseTokenStats``: tokens on the GPU and the CPU, and usage."""

    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


def sglang_transform() -> Transform:
    """SGLang's ``transform_index_page_table_decode`` from the installed package (imported when first
    needed: the adapter module imports no SGLang)."""
    from sglang.kernels.ops.attention.dsa.transform_index import transform_index_page_table_decode

    return transform_index_page_table_decode


def _unsupported(what: str) -> property:
    def get(self: UlakvSparseCoordinator) -> Any:
        raise UnsupportedBySGLangAdapter(f"{what} is not supported by the ulakv SGLang adapter")

    return property(get, doc=f"Raises: {what} is not supported.")


class UlakvSparseCoordinator:
    """The coordinator SGLang's DSA backend, model runner and scheduler call (same members and
    signatures as ``HiSparseCoordinator`` of sglang 0.5.23; ``tests/test_sglang_conformance.py`` holds
    them to the pinned source)."""

    num_real_reqs: torch.Tensor  # int32 [1]: real requests of the batch (SGLang fills it each step)
    device_buffer_size: int  # the shared GPU cache's slots (HiSparse: per-request device buffer)
    top_k: int
    ack_staging_queue: list[Admitted]
    store: SGLangStore | SGLangDcpStore

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        top_k: int,
        device_buffer_size: int,
        device: str | torch.device,
        tp_group: Any,
        host_to_device_ratio: int = 2,
        swap_in_block_size: int = 960,
        shared_index_layers: list[bool] | None = None,
        num_draft_tokens: int = 0,
    ) -> None:
        """Built by SGLang's model runner with HiSparse's arguments; the pool and its sizes come from
        the ulakv KV pool the allocator serves (``ulakv_store``). ``device_buffer_size``,
        ``host_to_device_ratio`` and ``swap_in_block_size`` size HiSparse's own buffers and have no
        counterpart. ``shared_index_layers`` is not used: the pool's layer groups were fixed when the
        KV pool was built, before this, from SGLang's ``skip_topk_layers``, which SGLang does not pass
        with ``--enable-hisparse`` (so each layer is a group of its own there, for now)."""
        store = token_to_kv_pool_allocator.get_kvcache().ulakv_store
        store.bound(max_queries=max(num_draft_tokens, 1), top_k=top_k)  # speculative verify: [B, Q, K]
        # Under DCP the backend localises: no transform, no swap-in here.
        transform = None if isinstance(store, SGLangDcpStore) else sglang_transform()
        self._setup(store, req_to_token_pool.req_to_token, top_k, transform)
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.tp_group = tp_group

    @classmethod
    def from_store(
        cls, store: SGLangStore, req_to_token: torch.Tensor, top_k: int, transform: Transform
    ) -> UlakvSparseCoordinator:
        """A coordinator over ``store`` and SGLang's ``req_to_token`` table (int32 ``[slots,
        max_context]``), turning positions into ``loc`` with ``transform`` (SGLang's; the CPU tests
        load it from the pinned wheel by path)."""
        self = cls.__new__(cls)
        self._setup(store, req_to_token, top_k, transform)
        return self

    def _setup(
        self,
        store: SGLangStore | SGLangDcpStore,
        req_to_token: torch.Tensor,
        top_k: int,
        transform: Transform | None,
    ) -> None:
        cfg = store.config
        self.store = store
        self.req_to_token = req_to_token
        self.top_k = top_k
        self.transform = transform
        self.device_buffer_size = self._tiers.gpu_slots
        device = store.pool.device
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=device)
        self.ack_staging_queue = []
        if transform is None:
            return
        self._rows = torch.arange(cfg.max_batch * cfg.max_queries, dtype=torch.int32, device=device)
        # Fixed buffers (CUDA graphs): the batch's page table rows and the transformed slots.
        self._locs = torch.full(
            (cfg.max_batch * cfg.max_queries, top_k), -1, dtype=torch.int32, device=device
        )

    # -- the per-layer call of the DSA backend -----------------------------------------------------
    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        compressed_seq_lens: torch.Tensor,
        top_k_result: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Slots of ``layer_id``'s ``kv_buffer`` for each request's top-k positions: ``top_k_result``
        int32 ``[B, K]`` (decode) or ``[B, Q, K]`` (speculative verify; ``compressed_seq_lens`` then
        per query), ``-1`` padding. Returns int32 of the same shape, ``-1`` for padding and for rows
        past ``num_real_reqs`` (a captured batch's padding)."""
        if self.transform is None:
            raise UnsupportedBySGLangAdapter(
                "swap_in_selected_pages under --dcp-size > 1: SGLang's DCP attention (the trtllm DSA "
                "backend) localises page tables through the ulakv pool; another --dsa-decode-backend "
                "or --dsa-prefill-backend reached the coordinator"
            )
        B = req_pool_indices.shape[0]
        Q = top_k_result.shape[1] if top_k_result.dim() == 3 else 1
        K = top_k_result.shape[-1]
        page_table = self.req_to_token.index_select(0, req_pool_indices.to(torch.int64))
        positions = top_k_result.reshape(B * Q, K)
        if Q > 1:
            page_table = page_table.repeat_interleave(Q, dim=0)
        locs = self.transform(page_table=page_table, topk_indices=positions, result=self._locs[: B * Q, :K])
        real = (self._rows[: B * Q] // Q < self.num_real_reqs).unsqueeze(1)
        locs = torch.where(real & (locs != 0), locs, -1)
        return self.store.slots(layer_id, locs.view(top_k_result.shape))

    @property
    def _tiers(self) -> Any:
        """The pool's ``Tiered`` config (a DCP rank's: its slice's)."""
        layout = self.store.pool.config.layout
        return layout.inner if isinstance(self.store, SGLangDcpStore) else layout

    # -- request lifecycle -----------------------------------------------------------------------
    def admit_request_into_staging(self, req: Any) -> None:
        """A request whose prefill finished: nothing to stage (its rows are in the pool); ready for
        decode at the scheduler's next ``collect_ready_reqs``."""
        req.hisparse_staging = True
        self.ack_staging_queue.append(Admitted(req))

    def collect_ready_reqs(self) -> list[Any]:
        """Every request admitted since the last call, in order (the same on every TP rank: no
        transfer to wait for, so no all-reduce)."""
        ready = [act.req for act in self.ack_staging_queue]
        self.ack_staging_queue = []
        for req in ready:
            req.hisparse_staging = False
        return ready

    def has_ongoing_staging(self) -> bool:
        return bool(self.ack_staging_queue)

    def abort_staging_request(self, req: Any) -> None:
        """Drop a request admitted but not collected yet (its slots are freed by SGLang's allocator)."""
        self.ack_staging_queue = [act for act in self.ack_staging_queue if act.req is not req]
        req.hisparse_staging = False

    def retract_req(self, req: Any) -> None:
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def request_finished(self, req: Any) -> None:
        """Nothing to free: the request's slots are SGLang's allocator's, released to the pool when it
        frees them (a cached prefix outlives the request). Orders later pool calls after the side
        stream's moves."""
        self.store.kv.join()

    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """HiSparse reserves a device slot for each new token here. ulakv needs none: the allocator made
        ``out_cache_loc`` live, and the token's write (``set_mla_kv_buffer``) gives it a home. No work
        by design (SGLang calls it every decode step), not a stand-in."""

    def wait_for_pending_backup(self) -> None:
        """HiSparse waits for its device-to-host backup; ulakv keeps no backup (one home per entry).
        Pool calls are ordered after the side stream here."""
        self.store.kv.join()

    def set_decode_producer_stream(self, stream: Any) -> None:
        """The scheduler's forward stream. No work by design: pool calls run on the current stream
        (the forward stream when SGLang calls them), so there is nothing to keep."""

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len  # no compressed (DeepSeek-V4) layout

    def get_token_stats(self) -> TokenStats:
        """Tokens on the GPU and the CPU (reads the pool's counters: a sync, for metrics only)."""
        stats = self.store.pool.stats()
        layout = self._tiers
        groups = self.store.pool.num_groups
        gpu, cpu = stats["gpu_slots_used"] // groups, stats["cpu_slots_used"] // groups
        return TokenStats(
            gpu, gpu / layout.gpu_slots, cpu, cpu / layout.cpu_slots if layout.cpu_slots else 0.0
        )

    def destroy(self) -> None:
        self.store.kv.join()

    # -- speculative decoding --------------------------------------------------------------------
    def allocate_spec_scratch(self, req_pool_indices: list[int]) -> None:
        """HiSparse keeps per-request scratch for draft tokens; draft tokens here are slots like any
        other (written by verify, freed by the allocator when rejected). No work by design."""

    def prepare_spec_verify(self, batch: Any) -> None:
        """No work by design: verify's ``[B, Q, K]`` selection is one ``prepare``."""

    def commit_spec_accept_tokens(self, batch: Any, accept_indices: torch.Tensor) -> None:
        """No work by design: accepted tokens keep their slots and rows; rejected ones are freed by
        SGLang's allocator."""

    # -- not served ------------------------------------------------------------------------------
    def admit_request_direct(self, req: Any) -> None:
        raise UnsupportedBySGLangAdapter(
            "prefill/decode disaggregation's direct-to-host admission is not supported by the ulakv "
            "SGLang adapter"
        )

    def swap_in_selected_blocks(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k_blocks: torch.Tensor,
        layer_id: int,
        sparse_block_size: int,
    ) -> torch.Tensor:
        raise UnsupportedBySGLangAdapter(
            "MiniMax-M3 block swap-in is not supported by the ulakv SGLang adapter"
        )

    mem_pool_host = _unsupported("HiSparse's host pool (prefill/decode disaggregation)")
    req_to_host_pool = _unsupported("HiSparse's host pool (prefill/decode disaggregation)")
    req_to_host_pool_allocated_len = _unsupported("HiSparse's host pool (prefill/decode disaggregation)")
    padded_buffer_size = _unsupported("HiSparse's per-request device buffer (prefill/decode disaggregation)")
    spec_swap = _unsupported("HiSparse's speculative scratch (prefill/decode disaggregation)")
    raw_indices_buffer = _unsupported("DeepSeek-V4's compressed HiSparse indexer")
