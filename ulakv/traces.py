"""Selection traces: what the indexer picks, step after step, for many requests and layer groups.

A trace holds *positions* (token indices within a request), not logical addresses: replaying it
admits each request into a real pool, which hands out the addresses. ``RequestTrace.topk`` is
int32 ``[steps, groups, queries, k]`` with -1 padding; SGLang's returned ``indexer_topk`` (int32
``[seqlen, num_indexer_layers, topk]`` per request) is the same with one query position.

``synthetic`` builds seeded traces with the ingredients reported for DSA-style top-k: attention
sinks, a local window, heavy hitters that drift slowly, far positions that change every step,
selections that differ a little between layer groups, and speculative decoding whose query
positions overlap heavily.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of a synthetic trace. Defaults: a small but DSA-shaped decode batch."""

    requests: int = 8
    prompt: tuple[int, int] = (1024, 2048)  # prompt lengths, uniform in [lo, hi]
    steps: int = 32  # decode steps per request
    topk: int = 128
    queries: int = 3  # speculative query positions a step (1: no speculation)
    groups: int = 2  # layer groups, one selection each
    sinks: int = 4
    window: int = 32  # most recent positions, always picked
    heavy: int = 48  # recurring positions per request
    drift: float = 0.05  # share of heavy hitters replaced each step
    far_reuse: float = 0.6  # share of last step's far picks picked again
    group_overlap: float = 0.85  # share of picks a group shares with the first group
    query_overlap: float = 0.9  # share of far picks a query position shares with the first
    arrival_spread: int = 8  # requests start decoding over the first this-many steps
    seed: int = 0


@dataclass
class RequestTrace:
    prompt_len: int
    arrival: int  # decode step at which the request is admitted and prefilled
    topk: torch.Tensor  # int32 [steps, groups, queries, k]; positions < prompt_len + step + 1

    @property
    def steps(self) -> int:
        return self.topk.shape[0]


@dataclass
class Trace:
    requests: list[RequestTrace]

    @property
    def groups(self) -> int:
        return self.requests[0].topk.shape[1]

    @property
    def queries(self) -> int:
        return self.requests[0].topk.shape[2]

    @property
    def topk(self) -> int:
        return self.requests[0].topk.shape[3]

    @property
    def horizon(self) -> int:
        """Decode steps until the last request finishes."""
        return max(r.arrival + r.steps for r in self.requests)

    def working_set(self) -> int:
        """Largest number of distinct positions one group selects in one step (all requests that
        are decoding then): the GPU capacity below which a step cannot be served at all."""
        worst = 0
        for step in range(self.horizon):
            for g in range(self.groups):
                n = 0
                for r in self.requests:
                    s = step - r.arrival
                    if 0 <= s < r.steps:
                        picks = r.topk[s, g].flatten()
                        n += int(picks[picks >= 0].unique().numel())
                worst = max(worst, n)
        return worst

    def save(self, path: str | Path) -> None:
        torch.save(
            {
                "format": "ulakv.trace/1",
                "requests": [
                    {"prompt_len": r.prompt_len, "arrival": r.arrival, "topk": r.topk} for r in self.requests
                ],
            },
            path,
        )

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = torch.load(path, weights_only=True)
        if data.get("format") != "ulakv.trace/1":
            raise ValueError(f"{path} is not a ulakv trace (format {data.get('format')!r})")
        return cls(
            [RequestTrace(int(r["prompt_len"]), int(r["arrival"]), r["topk"]) for r in data["requests"]]
        )

    @classmethod
    def from_sglang(
        cls,
        indexer_topk: list[torch.Tensor],
        prompt_lens: list[int] | None = None,
        arrivals: list[int] | None = None,
    ) -> Trace:
        """SGLang's returned ``indexer_topk``: one int32 ``[seqlen, num_indexer_layers, topk]`` per
        request, row i the selections of decode step i (-1 padding). Without ``prompt_lens``, a
        request's prompt is taken to end just before its first row's largest position plus one."""
        requests = []
        for i, t in enumerate(indexer_topk):
            if t.dim() != 3:
                raise ValueError(
                    f"request {i}: indexer_topk must be [seqlen, layers, topk], got {tuple(t.shape)}"
                )
            topk = t.to(torch.int32).unsqueeze(2)  # one query position
            prompt = prompt_lens[i] if prompt_lens else int(t[0].max()) + 1
            if int(t.max()) >= prompt + t.shape[0]:
                raise ValueError(f"request {i}: a position lies beyond the tokens that exist by then")
            requests.append(RequestTrace(prompt, arrivals[i] if arrivals else 0, topk))
        return cls(requests)


def _pick(gen: torch.Generator, high: int, n: int) -> torch.Tensor:
    return torch.randint(0, max(high, 1), (n,), generator=gen)


def synthetic(spec: SyntheticSpec = SyntheticSpec()) -> Trace:
    """A seeded DSA-shaped trace (see the module docstring)."""
    gen = torch.Generator().manual_seed(spec.seed)
    requests = []
    lo, hi = spec.prompt
    k, Q, G = spec.topk, spec.queries, spec.groups
    n_far = max(0, k - spec.sinks - spec.window - spec.heavy)
    for _ in range(spec.requests):
        prompt = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        arrival = int(torch.randint(0, spec.arrival_spread + 1, (1,), generator=gen))
        heavy = _pick(gen, prompt, spec.heavy)
        far = _pick(gen, prompt, n_far)
        topk = torch.full((spec.steps, G, Q, k), -1, dtype=torch.int32)
        for s in range(spec.steps):
            length = prompt + s + 1  # tokens that exist at this step (the new one included)
            swap = torch.rand(spec.heavy, generator=gen) < spec.drift
            heavy = torch.where(swap, _pick(gen, length, spec.heavy), heavy)
            keep = torch.rand(n_far, generator=gen) < spec.far_reuse
            far = torch.where(keep, far, _pick(gen, length, n_far))
            for g in range(G):
                g_heavy, g_far = heavy, far
                if g:
                    other = torch.rand(spec.heavy, generator=gen) >= spec.group_overlap
                    g_heavy = torch.where(other, _pick(gen, length, spec.heavy), heavy)
                    other = torch.rand(n_far, generator=gen) >= spec.group_overlap
                    g_far = torch.where(other, _pick(gen, length, n_far), far)
                for q in range(Q):
                    q_far = g_far
                    if q:
                        other = torch.rand(n_far, generator=gen) >= spec.query_overlap
                        q_far = torch.where(other, _pick(gen, length, n_far), g_far)
                    sinks = torch.arange(min(spec.sinks, length))
                    window = torch.arange(max(0, length - spec.window), length)
                    picks = torch.cat([sinks, window, g_heavy, q_far]).unique()[:k]
                    topk[s, g, q, : picks.numel()] = picks.to(torch.int32)
        requests.append(RequestTrace(prompt, arrival, topk))
    return Trace(requests)


def spec_dict(spec: SyntheticSpec) -> dict:
    return asdict(spec)
