"""Consecutive groups' calls share no control word or scratch (``TieredRunner`` call contexts), so
group ``g + 1``'s plan may run while group ``g``'s rows move.

Shown by construction, from the launches themselves: every tensor argument of every kernel a
group's write and prepare launch, as a memory range, against those of the next group's. The only
overlaps allowed are what neither call writes where the other looks: the callers' own inputs
(one selection may serve both), PB-LRU's level offsets (read-only), and the whole-tier row tensors,
of which a call touches only its own group's layers. Groups two apart share a context, and the
same check finds their shared words: it can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers import random_rows

from ulakv import PBLRU, EntrySpec, ExactLRU, InvalidAddressError, Pool, PoolConfig, Tiered
from ulakv.kernels._triton import INTERPRETED

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="records the interpreter's launches")

WIDTH = 8
SHARED_BY_DESIGN = {"sel_ptr", "rows_ptr", "lvl_ptr", "gpu_ptr", "cpu_ptr"}


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + t.element_size() * (last + 1)


def launched(fn) -> list[tuple[str, str, int, int]]:
    """(kernel, argument, start, end) of every non-empty tensor argument launched by ``fn()``."""
    from triton.runtime.interpreter import InterpretedFunction as launcher

    original, seen = launcher.run, []

    def run(self, *args, **kwargs):
        for name, t in [*enumerate(args), *kwargs.items()]:
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                seen.append((self.fn.__name__, str(name), *_span(t)))
        return original(self, *args, **kwargs)

    launcher.run = run
    try:
        fn()
    finally:
        launcher.run = original
    return seen


def shared(a, b) -> set[tuple[str, str]]:
    """Arguments of ``a``'s launches whose memory overlaps an argument of ``b``'s."""
    return {
        (ka, na)
        for ka, na, sa, ea in a
        for kb, nb, sb, eb in b
        if sa < eb and sb < ea and not (na in SHARED_BY_DESIGN and nb in SHARED_BY_DESIGN)
    }


def _pool(policy) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=5,
            layers_per_group=1,
            layout=Tiered(gpu_slots=8, cpu_slots=30, policy=policy),
            validate=False,
        )
    )


@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(3)], ids=["lru", "pblru"])
def test_consecutive_groups_share_no_call_word_or_scratch(policy) -> None:
    pool = _pool(policy)
    gen = torch.Generator().manual_seed(3)
    seq = pool.admit(20)
    for layer in range(5):
        pool.write(layer, seq.addresses, random_rows(gen, 20, WIDTH))
    selection = seq.addresses[4:10].view(1, 6)  # one selection for every group: read by all
    new, rows = seq.addresses[:3], random_rows(gen, 3, WIDTH)
    kept = []  # each group's slots, alive as an engine keeps them: no memory handed on

    def step(group: int):
        return launched(lambda: (pool.write(group, new, rows), kept.append(pool.prepare(group, selection))))

    calls = [step(g) for g in range(5)]
    for g in range(4):
        assert shared(calls[g], calls[g + 1]) == set(), f"groups {g} and {g + 1} share memory"
    # Two apart: the same context, and the check sees its words (control words, scratch, claims).
    two_apart = {name for _, name in shared(calls[1], calls[3])}
    # (Each group reports a refusal to a word of its own, so that the error can name the group.)
    assert {"ctl_ptr", "claim_ptr", "counts_ptr", "stats_ptr"} <= two_apart
    assert "report_ptr" not in two_apart
    pool.check()


def test_counters_and_refusals_span_the_contexts() -> None:
    pool = _pool(ExactLRU())
    gen = torch.Generator().manual_seed(4)
    seq = pool.admit(12)
    for layer in range(5):
        pool.write(layer, seq.addresses, random_rows(gen, 12, WIDTH))
    for group in range(5):
        pool.prepare(group, seq.addresses[6:].view(2, 3))  # 4 of them on the CPU: evictions
    stats = pool.stats()
    assert stats["hits"] + stats["misses"] == 5 * 6  # each group's six, whichever context counted
    assert stats["misses"] == stats["victims"] == 5 * 4 and stats["bytes_in"] == 5 * 4 * WIDTH
    pool.prepare(1, torch.tensor([[int(seq.addresses[0]), 40]]))  # context 1: not live
    with pytest.raises(InvalidAddressError, match=r"an earlier prepare of layer group 1 \(refused"):
        pool.prepare(2, seq.addresses[:2].view(1, 2))  # context 0 raises it
    pool.write(3, torch.tensor([40]), random_rows(gen, 1, WIDTH))  # context 1 again
    with pytest.raises(InvalidAddressError, match=r"an earlier write to layer group 3 \(refused"):
        pool.check()
    pool.check()
