"""The ulakv side of SGLang's decode context parallelism over a CPU tier: a rank's pool over
SGLang's token slots (``loc``), sized from SGLang's own flags.

Under ``--dcp-size D`` SGLang keeps ``loc`` ``s`` on rank ``s % D`` at row ``s // D`` of that rank's
device pool (``size`` rows). Here each rank's pool is ``Striped(world=D, rank, attention="local")``
over the engine-owned addresses ``[0, N)``: the same homes, in a GPU cache of ``size`` slots shared
by the rank's requests and, beneath it, an exclusive CPU tier, so that ``host_to_device_ratio``
times as many ``loc`` are live at once as SGLang's DCP holds on its GPUs alone (``N = (size x ratio
+ page_size) x D``, SGLang's ``loc`` space with ``size x ratio`` for ``size``; each rank homes
``N / D``). Every rank makes the same calls: it admits and releases every ``loc``, writes every new
token's row (keeping those homed on it) and localises every page table (``DcpLocalizer``: its GPU
slots of its own entries, packed, and the counts, for SGLang's DCP attention, which then merges the
ranks' parts by their LSE as it does today).

What SGLang keeps apart under DCP is left as it is: the indexer's keys stay in SGLang's own pool,
on every rank's GPU, for every ``loc`` of the DCP group (SGLang sizes that buffer ``(size +
page_size) x D - page_size``; here ``N``, ``ratio`` times more): 132 bytes a token and indexer
layer (128 fp8 values and a float32 scale). For DeepSeek-V3.2 (61 layers, each with an indexer)
that is 8,052 bytes a token on every rank, beside the 40,016 of its MLA rows split over the ranks
(5,002 a rank at ``D = 8``, which the CPU tier now takes): at ``D = 8`` the keys are what bounds a
rank's GPU, so the gain over SGLang's DCP is the latent rows' share, not ``ratio`` (a model that
reuses a top-k in most layers, GLM-5.3's 21 indexers of 78, pays 2,772 bytes a token a rank).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ...config import EntrySpec, ExactLRU, PolicyConfig, PoolConfig, Striped, Tiered
from ...engine.adapter import SparseKV
from ...errors import InvalidInputError
from ...pool import Pool
from .dcp import DcpLocalizer
from .store import FLASHMLA_PAGE, LocStore


@dataclass(frozen=True)
class DcpStoreConfig:
    """A rank's pool under SGLang's DCP from SGLang's sizes: ``device_tokens`` (a rank's device pool,
    ``size``: the GPU cache), ``host_to_device_ratio`` (HiSparse's flag: ``ratio - 1`` times that on
    the CPU), ``dcp_size``/``dcp_rank``, ``page_size`` (SGLang's 64-token DSA pages). ``group_starts``:
    the layers that compute a fresh top-k (``layer_groups``). ``max_batch`` x ``max_queries`` rows of
    ``top_k`` bound a decode (or verify) page table, whose localisation runs on the side stream; a
    larger one (a prefill chunk) runs on the current stream."""

    layers: int
    bytes_per_token: int
    device_tokens: int
    host_to_device_ratio: int
    dcp_size: int
    dcp_rank: int
    page_size: int = FLASHMLA_PAGE
    group_starts: tuple[int, ...] | None = None
    max_batch: int = 256
    max_queries: int = 1
    top_k: int = 2048
    policy: PolicyConfig = field(default_factory=ExactLRU)
    device: str | torch.device = "cpu"
    validate: bool | None = None

    def __post_init__(self) -> None:
        if self.host_to_device_ratio < 1:
            raise InvalidInputError(f"host_to_device_ratio must be >= 1, got {self.host_to_device_ratio}")

    @property
    def logical_tokens(self) -> int:
        """``loc`` live at once over the DCP group: every rank's GPU cache and CPU tier."""
        return self.dcp_size * self.device_tokens * self.host_to_device_ratio

    @property
    def address_space(self) -> int:
        """``loc`` in ``[0, N)``. Under DCP SGLang's paged allocator spans ``size x D`` tokens in
        pages of ``page_size x D`` and hands out pages from the second, so ``loc`` runs over
        ``[page x D, (size + page) x D)`` (its index buffer's ``(size + page) x D - page``); here
        ``size x ratio`` in place of ``size``."""
        return (self.device_tokens * self.host_to_device_ratio + self.page_size) * self.dcp_size

    def pool_config(self) -> PoolConfig:
        share = math.ceil(self.address_space / self.dcp_size)  # the most ``loc`` one rank homes
        inner = Tiered(gpu_slots=self.device_tokens, cpu_slots=share - self.device_tokens, policy=self.policy)
        return PoolConfig(
            entry=EntrySpec(self.bytes_per_token),
            num_layers=self.layers,
            group_starts=self.group_starts,
            layout=Striped(world=self.dcp_size, rank=self.dcp_rank, attention="local", inner=inner),
            device=self.device,
            validate=self.validate,
            engine_addresses=self.address_space,
            page_size=self.page_size,
        )


class SGLangDcpStore(LocStore):
    """One rank's pool bound to SGLang's DCP conventions (``loc`` 0 = padding). Every rank of the
    DCP group calls the same methods with the same arguments in the same order."""

    def __init__(self, config: DcpStoreConfig) -> None:
        self.config = config
        self.pool = Pool(config.pool_config())
        self._bind()

    def _bind(self) -> None:
        cfg = self.config
        self.kv = SparseKV(self.pool, max_batch=cfg.max_batch * cfg.max_queries, top_k=cfg.top_k)
        self.localizer = DcpLocalizer(self.pool, zero_is_padding=True, kv=self.kv)

    def bound(self, max_queries: int, top_k: int) -> None:
        """Size the side stream's buffers for ``[max_batch x max_queries, top_k]`` page tables (the
        coordinator knows SGLang's draft tokens and the model's top-k; the KV pool, built first,
        does not). Rebuilds them only when they grow, before any step."""
        cfg = self.config
        top_k = -(-top_k // 4) * 4  # SGLang pads the trtllm page table's width to a multiple of 4
        if max_queries <= cfg.max_queries and top_k <= cfg.top_k:
            return
        self.kv.join()
        self.config = dataclasses.replace(
            cfg, max_queries=max(max_queries, cfg.max_queries), top_k=max(top_k, cfg.top_k)
        )
        self._bind()

    def localize(
        self,
        layer: int,
        page_table: torch.Tensor,
        *,
        metadata: object = None,
        topk_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place of SGLang's ``localize_dcp_page_table``: ``page_table`` int32 ``[rows, topk]`` of
        ``loc`` (-1 or 0 padding) -> this rank's block table (slots of ``kv_rows(layer)``, packed, -1
        after) and the counts (SGLang's ``seq_lens`` for its DCP attention). ``metadata`` and
        ``topk_indices`` (the layer's top-k tensor) are SGLang's reuse keys: a layer that reuses the
        previous layer's top-k reuses its localisation."""
        return self.localizer.localize(
            layer, page_table, step=metadata, topk_indices=topk_indices, out=out, counts=counts
        )

    def prefill_localize(
        self,
        layer: int,
        page_table: torch.Tensor,
        *,
        metadata: object = None,
        topk_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk's ``[tokens, topk]`` page table, localised as ``localize`` does (with the
        same reuse keys), its refusal raised now (prefill is not captured; a sync): ``CapacityError``
        when the chunk's queries together select more distinct ``loc`` homed on one rank than its
        GPU cache takes at once (lower ``--chunked-prefill-size``)."""
        out = self.localize(layer, page_table, metadata=metadata, topk_indices=topk_indices)
        self.pool.check()
        return out
