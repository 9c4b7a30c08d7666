"""Decode context parallelism: attention over one rank's part of the history, merged by log-sum-exp.

A ``Striped(attention="local")`` pool hands each rank the slots of the selected entries homed on
it only. Each rank attends over its part and returns, besides its partial output, the log-sum-exp
of its scores; the ranks exchange both (one all-gather) and every rank merges them into the output
of attention over the whole selection, exactly as vLLM's and SGLang's decode context parallelism
do. Softmax over a union of disjoint parts is the LSE-weighted mean of the parts' softmax outputs:

    out = sum_r exp(lse_r - M) out_r / sum_r exp(lse_r - M),   M = max_r lse_r.

The merge is exact in real arithmetic; in float32 it reorders the sums (see ``docs/design.md``,
"Tensor parallelism", for the tolerance against attention on one device).

What moves per layer and step: every rank's ``[B, q, heads, value_dim]`` partial output and
``[B, q, heads]`` LSE (``partial_bytes``), whatever the selection; no KV row moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..layouts.row_exchange import all_gather


def partial_attention(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one rank's part. ``scores`` ``[B, q, heads, k]`` with ``-inf`` where
    an entry is not this rank's (or is padding), ``values`` ``[B, q, k, dim]`` (zeros there).
    Returns the partial output ``[B, q, heads, dim]`` and its log-sum-exp ``[B, q, heads]``
    (``-inf`` and zeros for a query with nothing on this rank)."""
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # a part with nothing here: exp(-inf) = 0 below
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.einsum("bqhk,bqkl->bqhl", weights, values) / torch.where(total > 0, total, 1.0)
    return out, (top + torch.log(total)).squeeze(-1)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Every rank's partial outputs ``[world, B, q, heads, dim]`` and LSEs ``[world, B, q, heads]``
    merged into attention over the whole selection ``[B, q, heads, dim]``. A query must have at
    least one entry on some rank (a selection is never all padding)."""
    top = lses.amax(dim=0, keepdim=True)
    scale = torch.exp(lses - top)  # 0 for a rank with nothing: its out is zeros, not NaN
    return (scale[..., None] * outs).sum(dim=0) / scale.sum(dim=0)[..., None]


def all_gather_partials(
    out: torch.Tensor, lse: torch.Tensor, world: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``(out, lse)`` on every rank, stacked rank by rank: one all-gather of both,
    packed as bytes (each keeps its dtype: a bf16 output beside a float32 LSE) into one buffer of a
    fixed size for a fixed batch (capturable)."""
    out_bytes = out.contiguous().view(-1).view(torch.uint8)
    packed = torch.cat([out_bytes, lse.contiguous().view(-1).view(torch.uint8)])
    gathered = packed.new_empty(world * packed.numel())
    all_gather(gathered, packed, group=group)
    gathered = gathered.view(world, -1)
    outs = gathered[:, : out_bytes.numel()].contiguous().view(out.dtype).view(world, *out.shape)
    lses = gathered[:, out_bytes.numel() :].contiguous().view(lse.dtype).view(world, *lse.shape)
    return outs, lses


def partial_bytes(batch: int, queries: int, heads: int, dim: int, world: int, element_bytes: int = 2) -> int:
    """Bytes one rank receives per layer and step: the other ``world - 1`` ranks' partial outputs
    (``batch x queries x heads x dim`` elements of ``element_bytes``) and LSEs (float32)."""
    per_rank = batch * queries * heads * (dim * element_bytes + 4)
    return (world - 1) * per_rank
