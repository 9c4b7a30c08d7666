"""Top-k over index keys striped across ranks: each rank scores only its own keys.

Under tensor parallelism the indexer's keys follow the KV rule: the key of logical address ``t``
lives on rank ``t mod world``. Every rank scores its local keys for the whole batch (the same
queries on every rank) and the ranks combine the scores into the global top-k. Two exact ways:

- ``topk_all_scores``: gather every rank's scores (the published method). Each rank receives the
  scores of every position: ``4 x context`` bytes a query, whatever ``k``.
- ``topk_merge``: each rank keeps its own top-k candidates, the ranks gather ``world x k``
  (score, position) pairs, and every rank merges them. Exact because each of the global top-k is
  among its own rank's top-k; ``8 x world x k`` bytes a query, whatever the context. Cheaper than
  gathering scores once the context exceeds ``2 x world x k`` (32 K at 8 ranks and k = 2048).

Both order by (score descending, position ascending), the order a stable descending sort of the
dense score row gives, so they return exactly what the single-GPU indexer returns, ties included.
Positions are int64 in, int64 out; -1 pads a request whose context is shorter than ``k``.
Both are collective: every rank of ``group`` calls them with the same ``k`` and shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def index_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scores ``[Q, n]`` of ``n`` keys ``[n, D]`` for ``Q`` queries ``[Q, D]``, each score reduced
    on its own: unlike a matmul, whose blocking depends on ``n``, a score's bits do not depend on
    which other keys are scored with it, so a rank scoring its stripe gets the dense scores exactly."""
    return (queries[:, None, :] * keys[None, :, :]).sum(-1)


def global_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The single-device reference: positions of the ``k`` best scores of each row of the dense
    ``[Q, context]`` scores, best first, ties towards the lower position; -1 pads."""
    Q = scores.shape[0]
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    pad = torch.full((Q, k - order.shape[1]), -1, dtype=order.dtype, device=order.device)
    return torch.cat([order, pad], dim=1)


def _best(scores: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best (score, position) pairs of each row in (score desc, position asc) order,
    padded with (-inf, -1). ``scores`` ``[Q, n]``, ``positions`` ``[Q, n]`` or ``[n]``."""
    Q = scores.shape[0]
    positions = positions.expand(Q, -1) if positions.dim() == 1 else positions
    by_position = torch.argsort(positions, dim=1, stable=True)  # ties: lower position first
    s = torch.gather(scores, 1, by_position)
    p = torch.gather(positions, 1, by_position)
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    s, p = torch.gather(s, 1, order), torch.gather(p, 1, order)
    pad = k - s.shape[1]
    if pad > 0:
        s = torch.cat([s, torch.full((Q, pad), float("-inf"), dtype=s.dtype, device=s.device)], dim=1)
        p = torch.cat([p, torch.full((Q, pad), -1, dtype=p.dtype, device=p.device)], dim=1)
    return s, p


def topk_merge(
    scores: torch.Tensor, positions: torch.Tensor, k: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, int]:
    """Global top-k from this rank's ``scores`` ``[Q, n_local]`` of its ``positions``
    ``[n_local]`` (int64): local top-k, one all-gather of ``world x k`` candidates, merge.
    Returns the positions ``[Q, k]`` and the bytes this rank received."""
    world = dist.get_world_size(group)
    vals, pos = _best(scores.float(), positions.to(torch.int64), k)
    packed = torch.cat([vals.view(torch.int32), pos.to(torch.int32)], dim=1)  # [Q, 2k] int32
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed, group=group)
    every = torch.stack(gathered)  # [world, Q, 2k]
    cand_vals = every[:, :, :k].contiguous().view(torch.float32).permute(1, 0, 2).reshape(scores.shape[0], -1)
    cand_pos = every[:, :, k:].to(torch.int64).permute(1, 0, 2).reshape(scores.shape[0], -1)
    cand_vals = torch.where(cand_pos >= 0, cand_vals, float("-inf"))
    _, best = _best(cand_vals, torch.where(cand_pos >= 0, cand_pos, torch.iinfo(torch.int64).max), k)
    received = (world - 1) * packed.numel() * packed.element_size()
    return torch.where(best == torch.iinfo(torch.int64).max, -1, best), received


def topk_all_scores(
    scores: torch.Tensor,
    positions_of: list[torch.Tensor],
    context: int,
    k: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, int]:
    """Global top-k by gathering every rank's scores: ``scores`` ``[Q, n_local]`` are this rank's,
    ``positions_of[r]`` (int64) the positions rank ``r`` scores, known to every rank (they follow
    from the addresses, which every rank holds). Only scores travel. Returns the positions ``[Q, k]``
    and the bytes this rank received."""
    world = dist.get_world_size(group)
    width = max(p.numel() for p in positions_of)
    Q = scores.shape[0]
    mine = torch.full((Q, width), float("-inf"), dtype=torch.float32, device=scores.device)
    mine[:, : scores.shape[1]] = scores.float()
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    dense = torch.full((Q, context), float("-inf"), dtype=torch.float32, device=scores.device)
    for r, pos in enumerate(positions_of):
        dense[:, pos] = gathered[r][:, : pos.numel()]
    received = (world - 1) * mine.numel() * mine.element_size()
    return global_topk(dense, k), received
