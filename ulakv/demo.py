"""The main job: three KV-cache systems under one memory budget, the same model and the same requests.

    python -m ulakv.demo            (or: make demo)

A batch of long-ish requests (prompts of about 4.7 x top-k tokens) arrives at once. Each system
gets the same GPU rows and the same CPU rows, admits requests in order until its pool refuses one
(the pool's own CapacityError decides: each request is admitted with its full length, prompt + new
tokens), and runs the reference decoder (``ulakv.engine.reference``: MLA latents, an indexer per
layer group, top-k, three speculative query positions) on what it admitted: a bulk prefill of every
prompt, then decode steps through the pool.

- GPU-only (SGLang-style): ``Tiered(gpu_slots=G, cpu_slots=0)``. No CPU tier: capacity is G.
- CPU offload (HiSparse-style): ``CPUOffloadBaseline``: the full history on the CPU, the same G GPU
  rows split into fixed per-request quotas of Q rows: G // Q requests at most. Q is HiSparse's
  ratio, 2 x top-k (4096 entries for top-k 2048), raised only if one request's step selects more
  (measured on the candidates; a quota cannot be lent, so it must hold that).
- ulakv: ``Tiered(gpu_slots=G, cpu_slots=C - S, staging_slots=S, policy=PBLRU(8))``: one home per
  entry, one GPU pool shared by all requests; S CPU rows stage evictions and cover one step's
  working set (measured on the candidates with a dense run), the other C - S hold history.

Every system's logits must be bit-identical (``torch.equal``) to a ``DenseKV`` run of the same
admitted requests, and requests admitted by several systems must generate the same tokens; any
difference raises.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from . import PBLRU, CapacityError, CPUOffloadBaseline, ExactLRU, Sequence, Tiered
from .engine.reference import DecoderSpec, DenseKV, PoolKV, Request, TinyDecoder, decode
from .kernels._triton import count_launches

ROW_BYTES = 1152  # one token-layer of the reference decoder: 576 bf16 latent dims


@dataclass(frozen=True)
class Budget:
    """The memory every system gets (rows of one layer group) and how the baselines split it."""

    gpu: int  # G: GPU rows
    cpu: int  # C: CPU rows
    quota: int  # Q: the offload baseline's GPU rows per request
    staging: int  # S: of the C CPU rows, what ulakv keeps for staging evictions

    def layouts(self, policy: ExactLRU | PBLRU) -> dict[str, Tiered | CPUOffloadBaseline]:
        G, C, Q, S = self.gpu, self.cpu, self.quota, self.staging
        return {
            "GPU-only": Tiered(gpu_slots=G, cpu_slots=0),
            "CPU offload": CPUOffloadBaseline(cpu_slots=C, slots_per_request=Q, max_requests=G // Q),
            "ulakv": Tiered(gpu_slots=G, cpu_slots=C - S, staging_slots=S, policy=policy),
        }


class Measured(PoolKV):
    """A pool store whose requests were admitted up front (:func:`reserve`), which keeps the pool's
    counters and the Triton launches so far (``launches``, a ``count_launches`` list) where
    decoding starts and at the peak: before the first release, when every request has decoded."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reserved: dict[int, Sequence] = {}  # request -> its sequence, admitted at full length
        self.launches: list[str] = []
        self.start: tuple[dict[str, int], int] | None = None
        self.peak: tuple[dict[str, int], int] | None = None

    def admit(self, rid: int) -> None:
        self.seqs[rid] = self.reserved.pop(rid)

    def mark(self) -> None:
        if self.start is None:
            self.start = self.pool.stats(), len(self.launches)

    def release(self, rid: int) -> None:
        if self.peak is None:
            self.peak = self.pool.stats(), len(self.launches)
        super().release(rid)


class WorkingSet(DenseKV):
    """A dense store that records the most distinct positions one group-step selects, summed over
    the batch (what ulakv's staging rows must cover) and for one request (what a quota must hold)."""

    most = 0
    most_one = 0

    def select(self, group: int, rids: list[int], positions: torch.Tensor) -> torch.Tensor:
        each = [int(p[p >= 0].unique().numel()) for p in positions]
        self.most = max(self.most, sum(each))
        self.most_one = max(self.most_one, *each)
        return positions


def workload(count: int, topk: int, new_tokens: int, seed: int) -> list[Request]:
    """``count`` requests arriving together, prompts of 4.5-4.9 x top-k tokens (about 1.6 quotas)."""
    rng = random.Random(seed)
    return [
        Request(
            tuple(rng.randrange(97) for _ in range(rng.randint(9 * topk // 2, 49 * topk // 10))),
            new_tokens,
            0,
        )
        for _ in range(count)
    ]


def reserve(store: Measured, requests: list[Request]) -> str:
    """Admit ``requests`` in order, each with its full length (prompt + new tokens), until the
    store's pool refuses one; returns the refusal. Decoding then never runs out of room."""
    for i, r in enumerate(requests):
        try:
            store.reserved[i] = store.pool.admit(len(r.prompt) + r.new_tokens)
        except CapacityError as err:
            return f"request {i + 1} refused: {err}"
    return "every request admitted"


def run(
    topk: int = 16,
    steps: int = 4,
    candidates: int = 10,
    seed: int = 0,
    policy: ExactLRU | PBLRU | None = None,
) -> dict[str, dict[str, float]]:
    """Run the three systems; print the table; return each system's row (with its wall ``seconds``,
    which the table leaves out so that the same arguments print the same text: the README's sample
    is this function's output, held to it by ``tests/test_demo.py``). Raises on any mismatch."""
    if min(topk, steps, candidates) < 1:
        raise ValueError(f"topk, steps and candidates must be >= 1, got {topk}, {steps}, {candidates}")
    queries = 3
    spec = DecoderSpec(topk=topk, queries=queries, seed=seed)
    model = TinyDecoder(spec)
    requests = workload(candidates, topk, steps + 1, seed)  # the first token comes from the prefill
    longest = max(len(r.prompt) + r.new_tokens for r in requests)

    # The budget in units of top-k: the GPU holds 12 x top-k rows (about 2.3 requests), the CPU
    # 40 x top-k (about 7.7); HiSparse's quota is 2 x top-k a request.
    working_set = WorkingSet(spec, candidates, longest)
    dense = {candidates: decode(model, working_set, requests, prefill=True)}
    quota = max(2 * topk, working_set.most_one)
    budget = Budget(gpu=12 * topk, cpu=40 * topk, quota=quota, staging=working_set.most)
    if budget.staging > budget.gpu:
        raise ValueError(
            f"one step of {candidates} candidates selects {budget.staging} entries, more than the "
            f"{budget.gpu} GPU rows: use fewer candidates"
        )
    prompts = sorted(len(r.prompt) for r in requests)
    print(
        f"model: {spec.layers} layers in {spec.groups} groups, {ROW_BYTES} B a token-layer, top-{topk}, "
        f"{queries} query positions\nwork:  {candidates} requests arrive together, prompts of "
        f"{prompts[0]}-{prompts[-1]} tokens + {steps + 1} new tokens each"
    )
    print(
        f"memory: G = {budget.gpu} GPU rows, C = {budget.cpu} CPU rows (a layer group) in every system\n"
        f"  offload quota Q = {quota} (2 x top-{topk}, HiSparse's ratio; one request's step selects at "
        f"most {working_set.most_one}), {budget.gpu // quota} quotas\n"
        f"  ulakv staging S = {budget.staging} of the C rows (the most one step of the {candidates} selects)"
    )

    rows: dict[str, dict[str, float]] = {}
    # Each request's tokens as the dense run of all candidates generated them: every system must agree.
    tokens = dict(enumerate(dense[candidates].tokens))
    for name, layout in budget.layouts(policy or PBLRU(8)).items():
        start = time.perf_counter()
        store = Measured(spec, layout, max_batch=candidates)
        refusal = reserve(store, requests)
        n = len(store.reserved)
        print(f"admission: {name:<12} admits {n}; {refusal}")
        if n == 0:
            raise ValueError(f"{name} admits no request: ask for fewer steps")
        admitted = requests[:n]
        if n not in dense:
            dense[n] = decode(model, DenseKV(spec, n, longest), admitted, prefill=True)
        with count_launches() as store.launches:
            pooled = decode(model, store, admitted, prefill=True, on_step=lambda step, m=store.mark: m())
        ref = dense[n]
        if len(pooled.logits) != len(ref.logits):
            raise AssertionError(f"{name}: {len(pooled.logits)} steps, dense {len(ref.logits)}")
        for step, (a, b) in enumerate(zip(ref.logits, pooled.logits, strict=True)):
            if not torch.equal(a, b):
                raise AssertionError(f"{name}: step {step}: logits differ from the dense run")
        if pooled.tokens != ref.tokens:
            raise AssertionError(f"{name}: generated tokens differ from the dense run")
        for i, t in enumerate(pooled.tokens):
            if tokens[i] != t:
                raise AssertionError(f"{name}: request {i} generated other tokens than in a larger batch")
        end = store.pool.stats()
        if end["live_addresses"] != 0:
            raise AssertionError(f"{name}: {end['live_addresses']} addresses live after every release")
        (begin, first), (peak, last) = store.start, store.peak
        hits, misses = peak["hits"] - begin["hits"], peak["misses"] - begin["misses"]
        rows[name] = {
            "admitted": n,
            "hit_rate": hits / max(hits + misses, 1),
            "bytes_in": (peak["bytes_in"] - begin["bytes_in"]) / steps,
            "bytes_out": (peak["bytes_out"] - begin["bytes_out"]) / steps,
            "distinct": peak["distinct_entries"],
            "slots": peak["physical_slots_used"],
            "launches": (last - first) / steps,
            "seconds": time.perf_counter() - start,
        }

    print(f"\nper decode step ({steps} after the prefill, decoding only):")
    head = f"{'system':<12} {'admitted':>8} {'hit rate':>9} {'KB to GPU':>10} {'KB to CPU':>10}"
    print(f"{head} {'distinct / slots at peak':>26} {'launches':>9}  outputs verified")
    for name, r in rows.items():
        ratio = f"{r['distinct']} / {r['slots']} = {r['distinct'] / r['slots']:.3f}"
        print(
            f"{name:<12} {r['admitted']:>8} {r['hit_rate']:>9.1%} {r['bytes_in'] / 1e3:>10.1f} "
            f"{r['bytes_out'] / 1e3:>10.1f} {ratio:>26} {r['launches']:>9.0f}  bit-exact vs dense"
        )
    base, offload, ours = (rows[name]["admitted"] for name in ("GPU-only", "CPU offload", "ulakv"))
    print(
        f"ulakv admits {ours / offload:.1f}x the offload baseline's requests, {ours / base:.1f}x GPU-only's."
    )
    print("KB to CPU: the offload baseline's eager backup of new tokens; ulakv's evictions.")
    print("Slots at peak count every copy: the offload baseline's GPU rows are copies of CPU rows.")
    print("Verified: every system's logits equal a dense run of its own requests bit for bit, and")
    print("each request generated the same tokens in every system that admitted it.")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="ulakv demo", description="GPU-only, CPU offload and ulakv under one memory budget"
    )
    parser.add_argument("--topk", type=int, default=16, help="top-k; the budget and prompts scale with it")
    parser.add_argument("--steps", type=int, default=4, help="decode steps after the prefill")
    parser.add_argument("--requests", type=int, default=10, help="candidate requests, arriving together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy", choices=["lru", "pblru"], default="pblru", help="ulakv's: exact LRU or PB-LRU(8)"
    )
    args = parser.parse_args(argv)
    run(args.topk, args.steps, args.requests, args.seed, ExactLRU() if args.policy == "lru" else PBLRU(8))


if __name__ == "__main__":
    main()
