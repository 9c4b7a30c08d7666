"""A tiny seeded sparse-attention decoder with the real structure, to show the pool changes nothing.

* MLA-style latent KV: one 576-dim latent per token and layer (512 content + 64 rope dims), shared by
  all heads, stored as bf16 bytes (1152 B a token-layer), written when the layer computes it.
* An indexer per layer group scores *every* past position with its own small keys, which stay dense
  and GPU-resident (never offloaded), and picks the top-k; every layer of the group attends only to
  those positions (ties broken towards the lower position). Under tensor parallelism (a striped
  pool) each rank scores only the positions homed on it and the ranks merge their candidates
  (``ulakv.engine.indexer``), which gives the same picks bit for bit.
* Optional speculative queries: ``queries`` query positions per request and step whose indexer
  queries differ slightly, so selections are ``[batch, queries, k]`` and overlap heavily; the first
  query's logits decide the next token (drafts are scored, not accepted: what matters to the pool is
  the shape and overlap of the selections).
* Greedy decoding; requests arrive and finish at different steps; prompts are fed token by token.

The KV store is pluggable: ``DenseKV`` keeps every latent in one tensor indexed by position; ``PoolKV``
keeps them in a ``ulakv.Pool`` and speaks logical addresses. The same model over either store must
give bit-identical logits: the pool only moves bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import EntrySpec, PoolConfig, Tiered
from ..pool import Pool
from .adapter import GroupStep, SparseKV
from .indexer import global_topk, index_scores, topk_merge

LATENT = 512
ROPE = 64
WIDTH = LATENT + ROPE


@dataclass(frozen=True)
class DecoderSpec:
    vocab: int = 97
    hidden: int = 64
    layers: int = 4
    layers_per_group: int = 2
    heads: int = 4
    index_dim: int = 32
    topk: int = 24
    queries: int = 1
    seed: int = 0

    @property
    def groups(self) -> int:
        return -(-self.layers // self.layers_per_group)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    new_tokens: int
    arrival: int


def dense_pick(queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer on one device: score every past position, keep the ``k`` best (ties towards
    the lower position), -1 padding: ``[Q, k]``."""
    return global_topk(index_scores(queries, keys), k)


class DenseKV:
    """All latents in one tensor per layer: the reference the pool must match."""

    def __init__(self, spec: DecoderSpec, requests: int, max_len: int) -> None:
        self.spec = spec
        self.kv = torch.zeros((spec.layers, requests, max_len, WIDTH), dtype=torch.bfloat16)

    def admit(self, rid: int) -> None:
        pass

    def release(self, rid: int) -> None:
        pass

    def write(self, layer: int, rids: list[int], positions: list[int], latents: torch.Tensor) -> None:
        self.kv[layer, rids, positions] = latents

    def pick(self, group: int, rid: int, queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
        return dense_pick(queries, keys, k)

    def select(self, group: int, rids: list[int], positions: torch.Tensor) -> torch.Tensor:
        return positions

    def rows(self, layer: int, rids: list[int], handle: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, Q, K, WIDTH]`` of the selected positions (padding rows are zeros)."""
        idx = handle.clamp(min=0)
        out = torch.stack([self.kv[layer, r][idx[b]] for b, r in enumerate(rids)])
        return torch.where((handle >= 0)[..., None], out, torch.zeros((), dtype=out.dtype))


class PoolKV:
    """Latents in a ulakv pool, through the engine adapter: positions become logical addresses, a
    group's selection becomes one ``GroupStep`` whose slots every layer of the group reads after
    waiting for its own rows. ``prefetch`` splits each group's moves (first layer, then the rest)."""

    def __init__(
        self,
        spec: DecoderSpec,
        layout: Tiered,
        device: str = "cpu",
        max_batch: int = 16,
        prefetch: bool | None = True,
    ) -> None:
        self.pool = Pool(
            PoolConfig(
                entry=EntrySpec(bytes_per_layer=WIDTH * 2),
                num_layers=spec.layers,
                layers_per_group=spec.layers_per_group,
                layout=layout,
                device=device,
            )
        )
        # A striped pool (tensor parallelism) is driven directly: its prepare is collective.
        self.kv = (
            SparseKV(
                self.pool, max_batch=max_batch, top_k=spec.topk, max_queries=spec.queries, prefetch=prefetch
            )
            if isinstance(self.pool, Pool)
            else None
        )
        self.seqs: dict[int, object] = {}
        self.indexer_bytes = 0  # received by the striped indexer's merges (tensor parallelism)

    def admit(self, rid: int) -> None:
        self.seqs[rid] = self.pool.admit(0)

    def release(self, rid: int) -> None:
        (self.kv or self.pool).release(self.seqs.pop(rid))

    def write(self, layer: int, rids: list[int], positions: list[int], latents: torch.Tensor) -> None:
        addrs = []
        for r, p in zip(rids, positions, strict=True):
            seq = self.seqs[r]
            if layer == 0 and p == len(seq):
                self.pool.extend(seq, 1)
            addrs.append(seq.addresses[p])
        rows = latents.contiguous().view(torch.uint8).view(len(rids), -1)
        (self.kv or self.pool).write(layer, torch.stack(addrs), rows)

    def pick(self, group: int, rid: int, queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
        """The indexer's top-k. Under tensor parallelism each rank scores only the keys of the
        positions homed on it (address mod world) and the ranks merge their top-k candidates."""
        if self.kv is not None:
            return dense_pick(queries, keys, k)
        world, rank = self.pool.world, self.pool.rank
        addresses = self.seqs[rid].addresses[: keys.shape[0]]
        mine = torch.nonzero(addresses % world == rank).flatten().to(keys.device)
        picks, received = topk_merge(index_scores(queries, keys[mine]), mine, k)
        self.indexer_bytes += received
        return picks

    def select(self, group: int, rids: list[int], positions: torch.Tensor) -> GroupStep:
        addrs = torch.stack(
            [
                torch.where(positions[b] >= 0, self.seqs[r].addresses[positions[b].clamp(min=0)], -1)
                for b, r in enumerate(rids)
            ]
        )
        if self.kv is None:
            slots = self.pool.prepare(group, addrs).slots
            return GroupStep(group, self.pool.group_layers(group), slots, None)
        return self.kv.prepare(group, addrs)

    def rows(self, layer: int, rids: list[int], step: GroupStep) -> torch.Tensor:
        slots = step.wait(layer)
        buf = self.pool.gpu_buffer(layer).view(torch.bfloat16)
        out = buf[slots.clamp(min=0).long()]
        return torch.where((slots >= 0)[..., None], out, torch.zeros((), dtype=out.dtype))


class TinyDecoder:
    """Random weights, real structure (see the module docstring)."""

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        gen = torch.Generator().manual_seed(spec.seed)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        s = spec
        self.embed = torch.randn(s.vocab, s.hidden, generator=gen)
        self.w_kv = [weight(s.hidden, WIDTH) for _ in range(s.layers)]
        self.w_q = [weight(s.hidden, s.heads * WIDTH) for _ in range(s.layers)]
        self.w_o = [weight(s.heads * LATENT, s.hidden) for _ in range(s.layers)]
        self.w_iq = [weight(s.hidden, s.index_dim) for _ in range(s.groups)]
        # Speculative query positions see almost the same context: their indexer queries are the
        # first one plus a small perturbation, so their selections overlap heavily, as in MTP drafts.
        self.w_iq_draft = [0.1 * weight(s.hidden, (s.queries - 1) * s.index_dim) for _ in range(s.groups)]
        self.w_ik = [weight(s.hidden, s.index_dim) for _ in range(s.groups)]
        self.unembed = weight(s.hidden, s.vocab)

    def step(
        self, store, keys: list[list[torch.Tensor]], rids: list[int], tokens: list[int], positions: list[int]
    ):
        """One decode step of the active requests: returns logits ``[B, vocab]`` (first query)."""
        s = self.spec
        B, Q, K = len(rids), s.queries, s.topk
        x = self.embed[torch.tensor(tokens)]
        for g in range(s.groups):
            layers = range(g * s.layers_per_group, min((g + 1) * s.layers_per_group, s.layers))
            # Indexer: this token's key joins its request's dense keys; every past position is scored.
            new_keys = x @ self.w_ik[g]
            base = (x @ self.w_iq[g])[:, None, :]
            queries = torch.cat([base, base + (x @ self.w_iq_draft[g]).view(B, Q - 1, s.index_dim)], dim=1)
            picks = torch.full((B, Q, K), -1, dtype=torch.int64)
            first = layers[0]
            store.write(first, rids, positions, (x @ self.w_kv[first]).to(torch.bfloat16))
            for b, r in enumerate(rids):
                keys[g][r].append(new_keys[b])
                picks[b] = store.pick(g, r, queries[b], torch.stack(keys[g][r]), K)
            handle = store.select(g, rids, picks)
            for layer in layers:
                if layer != first:
                    store.write(layer, rids, positions, (x @ self.w_kv[layer]).to(torch.bfloat16))
                kv = store.rows(layer, rids, handle).float()  # [B, Q, K, WIDTH]
                q = (x @ self.w_q[layer]).view(B, s.heads, WIDTH)
                scores = torch.einsum("bhw,bqkw->bqhk", q, kv) / math.sqrt(WIDTH)
                scores = scores.masked_fill((picks < 0)[:, :, None, :], float("-inf"))
                attn = torch.softmax(scores, dim=-1)
                out = torch.einsum("bqhk,bqkl->bqhl", attn, kv[..., :LATENT])[:, 0]  # first query
                x = torch.tanh(x + out.reshape(B, -1) @ self.w_o[layer])
        return x @ self.unembed


def generate(model: TinyDecoder, store, requests: list[Request]) -> list[torch.Tensor]:
    """Run every request to completion through ``store``; returns the logits of every step, in
    order (one ``[active, vocab]`` tensor a step)."""
    s = model.spec
    keys = [{i: [] for i in range(len(requests))} for _ in range(s.groups)]
    fed = [0] * len(requests)  # tokens fed so far (prompt and generated)
    generated: list[list[int]] = [[] for _ in requests]
    logits_log = []
    step = 0
    while any(len(generated[i]) < r.new_tokens for i, r in enumerate(requests)):
        active = []
        for i, r in enumerate(requests):
            if r.arrival == step:
                store.admit(i)
            if r.arrival <= step and len(generated[i]) < r.new_tokens:
                active.append(i)
        if active:
            tokens = [
                requests[i].prompt[fed[i]] if fed[i] < len(requests[i].prompt) else generated[i][-1]
                for i in active
            ]
            logits = model.step(store, keys, active, tokens, [fed[i] for i in active])
            logits_log.append(logits)
            for b, i in enumerate(active):
                fed[i] += 1
                if fed[i] >= len(requests[i].prompt):
                    generated[i].append(int(torch.argmax(logits[b])))
                    if len(generated[i]) == requests[i].new_tokens:
                        store.release(i)
        step += 1
    return logits_log
