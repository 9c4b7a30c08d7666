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
* Greedy decoding; requests arrive and finish at different steps. Prompts are fed token by token
  (each prompt token a step through the store), or with ``prefill=True`` in one pass a request:
  dense causal attention over the prompt itself and one store write a layer, decoding then starting
  from the last prompt token's output (long histories in few steps).

* Decode context parallelism (a ``Striped(attention="local")`` pool): each rank attends over the
  selected entries homed on it (address mod world), returns its partial output with its
  log-sum-exp, and the ranks merge them (``ulakv.engine.context_parallel``).

The KV store is pluggable: ``DenseKV`` keeps every latent in one tensor indexed by position; ``PoolKV``
keeps them in a ``ulakv.Pool`` and speaks logical addresses. The same model over either store must
give bit-identical logits: the pool only moves bytes. ``DenseKV(world=...)`` is the dense reference
of a split: it keeps every latent, but attends rank by rank over each rank's part, as decode
context parallelism does, and merges the parts in the same order, so a local-mode striped pool
must match it bit for bit; against attention on one device the split differs only by float32
rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..address_space import LogicalAllocator, addresses_on
from ..config import CPUOffloadBaseline, EntrySpec, PoolConfig, Replicated, Striped, Tiered
from ..layouts.tiered import TieredPool
from ..pool import Pool
from .adapter import GroupStep, SparseKV
from .context_parallel import all_gather_partials, merge_partials, partial_attention
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


# What a store hands the attention of one layer: the parts this process attends over, each the
# selected rows ``[B, Q, K, WIDTH]`` (zeros where not attended) and which it attends ``[B, Q, K]``.
Part = tuple[torch.Tensor, torch.Tensor]


class DenseKV:
    """All latents in one tensor per layer: the reference the pool must match. With ``world > 1``,
    the reference of decode context parallelism: positions get logical addresses exactly as a
    striped pool hands them out (the same lowest-first allocator, the same calls), and attention
    runs over each rank's part (addresses homed on it) in turn, then merges them."""

    def __init__(self, spec: DecoderSpec, requests: int, max_len: int, world: int = 1) -> None:
        self.spec = spec
        self.kv = torch.zeros((spec.layers, requests, max_len, WIDTH), dtype=torch.bfloat16)
        self.world = world
        self.split = world > 1
        self._allocator = LogicalAllocator(requests * max_len)  # never exhausted: only the order matters
        self._runs: dict[int, list[range]] = {}

    def admit(self, rid: int) -> None:
        self._runs[rid] = []

    def release(self, rid: int) -> None:
        self._allocator.give_back(self._runs.pop(rid))

    def write(self, layer: int, rids: list[int], positions: list[int], latents: torch.Tensor) -> None:
        self.kv[layer, rids, positions] = latents
        if layer == 0:  # a pool store extends its requests here, request by request in this order
            for r in dict.fromkeys(rids):
                need = max(p for q, p in zip(rids, positions, strict=True) if q == r) + 1
                have = sum(len(run) for run in self._runs[r])
                if need > have:
                    self._runs[r] += self._allocator.take(need - have)

    def pick(self, group: int, rid: int, queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
        return dense_pick(queries, keys, k)

    def select(self, group: int, rids: list[int], positions: torch.Tensor) -> torch.Tensor:
        return positions

    def parts(self, layer: int, rids: list[int], handle: torch.Tensor) -> list[Part]:
        """The latents of the selected positions ``[B, Q, K, WIDTH]``: one part, or one a rank."""
        idx = handle.clamp(min=0)
        rows = torch.stack([self.kv[layer, r][idx[b]] for b, r in enumerate(rids)])
        if not self.split:
            return [_attended(rows, handle >= 0)]
        homes = torch.stack(
            [
                addresses_on(self._runs[r], torch.device("cpu"))[idx[b]] % self.world
                for b, r in enumerate(rids)
            ]
        )
        return [_attended(rows, (handle >= 0) & (homes == rank)) for rank in range(self.world)]

    def combine(self, partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Every rank's partial output and LSE, merged (the ranks' order)."""
        outs, lses = zip(*partials, strict=True)
        return merge_partials(torch.stack(outs), torch.stack(lses))


def _attended(rows: torch.Tensor, valid: torch.Tensor) -> Part:
    return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype)), valid


class PoolKV:
    """Latents in a ulakv pool, through the engine adapter: positions become logical addresses, a
    group's selection becomes one ``GroupStep`` whose slots every layer of the group reads after
    waiting for its own rows. ``prefetch`` splits each group's moves (first layer, then the rest).

    Pools that are not a :class:`Pool` are driven directly: a striped pool (its prepare is
    collective, its indexer merges candidates across ranks) and the CPU-offload baseline (its
    slots index its per-request buffers; its indexer is the dense one)."""

    def __init__(
        self,
        spec: DecoderSpec,
        layout: Tiered | Striped | Replicated | CPUOffloadBaseline,
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
        self.striped = isinstance(layout, Striped)
        self.split = self.striped and layout.local  # decode context parallelism: attend over a part
        self.kv = (
            SparseKV(
                self.pool, max_batch=max_batch, top_k=spec.topk, max_queries=spec.queries, prefetch=prefetch
            )
            if isinstance(self.pool, TieredPool)  # plan and run: the kinds SparseKV drives
            else None
        )
        self.seqs: dict[int, object] = {}
        self.indexer_bytes = 0  # received by the striped indexer's merges (tensor parallelism)
        self.partial_bytes = 0  # received by the merges of partial attention (local mode)

    def admit(self, rid: int) -> None:
        self.seqs[rid] = self.pool.admit(0)

    def release(self, rid: int) -> None:
        (self.kv or self.pool).release(self.seqs.pop(rid))

    def write(self, layer: int, rids: list[int], positions: list[int], latents: torch.Tensor) -> None:
        """Rows for ``(rid, position)`` pairs: one token of each of a batch of requests, or a
        whole prompt of one request. The first layer's write extends a request to cover them."""
        device = self.pool.device
        where: dict[int, list[int]] = {}  # request -> its rows, in order
        for i, r in enumerate(rids):
            where.setdefault(r, []).append(i)
        addrs = torch.empty(len(rids), dtype=torch.int64, device=device)
        for r, rows_of_r in where.items():
            seq = self.seqs[r]
            mine = [positions[i] for i in rows_of_r]
            if layer == 0 and max(mine) >= len(seq):
                self.pool.extend(seq, max(mine) + 1 - len(seq))
            addrs[rows_of_r] = seq.addresses[torch.tensor(mine, device=device)]
        rows = latents.contiguous().view(torch.uint8).view(len(rids), -1)
        (self.kv or self.pool).write(layer, addrs, rows)

    def pick(self, group: int, rid: int, queries: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
        """The indexer's top-k. Under tensor parallelism each rank scores only the keys of the
        positions homed on it (address mod world) and the ranks merge their top-k candidates."""
        if not self.striped:
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

    def parts(self, layer: int, rids: list[int], step: GroupStep) -> list[Part]:
        """The rows the slots point at; in local mode only this rank's part (-1: not attended)."""
        slots = step.wait(layer)
        buf = self.pool.gpu_buffer(layer).view(torch.bfloat16)
        return [_attended(buf[slots.clamp(min=0).long()], slots >= 0)]

    def combine(self, partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """This rank's partial output and LSE, gathered from every rank and merged."""
        ((out, lse),) = partials
        outs, lses = all_gather_partials(out, lse, self.pool.world)
        self.partial_bytes += (self.pool.world - 1) * (out.numel() * out.element_size() + lse.numel() * 4)
        return merge_partials(outs, lses)


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
                q = (x @ self.w_q[layer]).view(B, s.heads, WIDTH)
                out = self._attend(store, q, store.parts(layer, rids, handle))[:, 0]  # first query
                x = torch.tanh(x + out.reshape(B, -1) @ self.w_o[layer])
        return x @ self.unembed

    @staticmethod
    def _attend(store, q: torch.Tensor, parts: list[Part]) -> torch.Tensor:
        """Sparse attention of ``q`` ``[B, heads, WIDTH]`` over the selected latents: ``[B, Q,
        heads, LATENT]``. A split store's parts are attended one by one and merged by LSE."""

        def scores(kv: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            s = torch.einsum("bhw,bqkw->bqhk", q, kv) / math.sqrt(WIDTH)
            return s.masked_fill(~valid[:, :, None, :], float("-inf"))

        parts = [(rows.float(), valid) for rows, valid in parts]
        if getattr(store, "split", False):
            return store.combine([partial_attention(scores(kv, ok), kv[..., :LATENT]) for kv, ok in parts])
        ((kv, valid),) = parts
        return torch.einsum("bqhk,bqkl->bqhl", torch.softmax(scores(kv, valid), dim=-1), kv[..., :LATENT])

    def prefill(
        self, store, keys: list[list[torch.Tensor]], rids: list[int], prompts: list[tuple[int, ...]]
    ) -> torch.Tensor:
        """Every prompt token of the requests ``rids`` in one pass: dense causal attention over each
        prompt itself (nothing read from the store, no selection), one ``store.write`` per layer of
        all the prompts' latents, every index key appended. Returns the logits of each prompt's last
        token ``[len(rids), vocab]``. Each request is computed on its own (its bits do not depend on
        which requests share the pass); only the writes are batched, to keep launches few."""
        s = self.spec
        xs = [self.embed[torch.tensor(p)] for p in prompts]
        owners = [r for r, p in zip(rids, prompts, strict=True) for _ in p]
        positions = [i for p in prompts for i in range(len(p))]
        for g in range(s.groups):
            for r, x in zip(rids, xs, strict=True):
                keys[g][r].extend((x @ self.w_ik[g]).unbind(0))
            for layer in range(g * s.layers_per_group, min((g + 1) * s.layers_per_group, s.layers)):
                latents = [(x @ self.w_kv[layer]).to(torch.bfloat16) for x in xs]
                store.write(layer, owners, positions, torch.cat(latents))
                for i, (x, lat) in enumerate(zip(xs, latents, strict=True)):
                    P = x.shape[0]
                    kv = lat.float()  # what decoding reads back: the bf16 bytes the store holds
                    q = (x @ self.w_q[layer]).view(P, s.heads, WIDTH)
                    scores = torch.einsum("phw,kw->phk", q, kv) / math.sqrt(WIDTH)
                    future = torch.ones(P, P, dtype=torch.bool).triu(1)[:, None, :]  # key after query
                    attn = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
                    out = torch.einsum("phk,kl->phl", attn, kv[:, :LATENT])
                    xs[i] = torch.tanh(x + out.reshape(P, -1) @ self.w_o[layer])
        return torch.stack([x[-1] for x in xs]) @ self.unembed


@dataclass(frozen=True)
class Decoded:
    """What :func:`decode` returns: the logits of every step in order (one ``[rows, vocab]``
    tensor a step; a bulk prefill's last-token logits are an entry of their own) and every
    request's generated tokens."""

    logits: list[torch.Tensor]
    tokens: list[list[int]]


def decode(
    model: TinyDecoder,
    store,
    requests: list[Request],
    *,
    prefill: bool = False,
    on_step: Callable[[int], object] | None = None,
    forced: list[list[int]] | None = None,
) -> Decoded:
    """Run every request to completion through ``store``. ``prefill``: the prompts of a step's
    arrivals are computed in one pass (:meth:`TinyDecoder.prefill`), each request's first token
    comes from its prompt's last position, and it decodes from that step on; otherwise each prompt
    token is a step. ``on_step(step)`` runs before each step's decode, after that step's arrivals are
    admitted and prefilled: a caller's measuring point. ``forced``: every request's tokens are these
    (an earlier run's ``tokens``) instead of the argmax of its logits, so that two runs whose logits
    differ by rounding are compared on the same inputs (teacher forcing)."""
    s = model.spec
    keys = [{i: [] for i in range(len(requests))} for _ in range(s.groups)]
    fed = [0] * len(requests)  # tokens fed so far (prompt and generated)
    generated: list[list[int]] = [[] for _ in requests]
    logits_log = []

    def emit(i: int, logits: torch.Tensor) -> None:
        generated[i].append(int(torch.argmax(logits)) if forced is None else forced[i][len(generated[i])])
        if len(generated[i]) == requests[i].new_tokens:
            store.release(i)

    step = 0
    while any(len(generated[i]) < r.new_tokens for i, r in enumerate(requests)):
        arrived = [i for i, r in enumerate(requests) if r.arrival == step]
        for i in arrived:
            store.admit(i)
        prompts = [i for i in arrived if requests[i].new_tokens > 0] if prefill else []
        if prompts:
            logits = model.prefill(store, keys, prompts, [requests[i].prompt for i in prompts])
            logits_log.append(logits)
            for b, i in enumerate(prompts):
                fed[i] = len(requests[i].prompt)
                emit(i, logits[b])
        active = [i for i, r in enumerate(requests) if r.arrival <= step and len(generated[i]) < r.new_tokens]
        if on_step is not None:
            on_step(step)
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
                    emit(i, logits[b])
        step += 1
    return Decoded(logits_log, generated)


def generate(
    model: TinyDecoder, store, requests: list[Request], *, prefill: bool = False
) -> list[torch.Tensor]:
    """Run every request to completion through ``store``; returns the logits of every step, in
    order (one ``[active, vocab]`` tensor a step). See :func:`decode`."""
    return decode(model, store, requests, prefill=prefill).logits
