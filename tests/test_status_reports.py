"""A refused call is learnt of without a copy, an event or a wait (``ulakv.deferred``).

Counted over decode steps of many layer groups (each a write of the step's tokens and a prepare),
driven as an engine drives them: every operation that copies tensor data on the host's behalf or
reads a value back (``copy_``, ``_to_copy``, ``item`` ...) made by ulakv's own code, outside the
Triton interpreter, is at most one a step (it is none). Before the report word every
non-validating call copied its status word out: one copy a call, here 2 x 7 a step. The errors:
raised at the next call, naming the kind of call refused and how many were, once (not again by
``check``), and never twice in a validating pool.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from helpers import assert_same_state, random_rows
from nosync import _triton_dir, skip_under_debug
from torch.utils._python_dispatch import TorchDispatchMode

import ulakv
from ulakv import (
    PBLRU,
    EntrySpec,
    ExactLRU,
    InvalidAddressError,
    Pool,
    PoolConfig,
    Tiered,
)
from ulakv.deferred import DeferredStatus, Refusal
from ulakv.engine import SparseKV
from ulakv.kernels import common as K
from ulakv.kernels._triton import tl, triton

WIDTH = 24
_ULAKV = os.path.dirname(os.path.abspath(ulakv.__file__)) + os.sep
_TESTS = os.path.dirname(os.path.abspath(__file__)) + os.sep
GROUPS = 7  # one layer a group, as SGLang drives a DSA model (an indexer a layer)

# Every aten op that moves tensor data between tensors or to a Python value.
_READ_BACKS = {"copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "_local_scalar_dense"}


class _ReadBackCounter(TorchDispatchMode):
    """Counts the ops of ``_READ_BACKS`` that ulakv's (or the test's) code makes; those the Triton
    interpreter makes to run a kernel on the CPU are not the pool's."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self._triton = _triton_dir()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _READ_BACKS and not self._made_by_triton():
            self.seen.append(name)
        return func(*args, **(kwargs or {}))

    def _made_by_triton(self) -> bool:
        """The innermost frame of ulakv, the tests (this mode aside) or triton is triton's."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self._triton):
                return True
            if name != __file__ and (name.startswith(_ULAKV) or name.startswith(_TESTS)):
                return False
            frame = frame.f_back
        return False


def _pool(policy, *, validate: bool = False, engine_addresses: int | None = None) -> Pool:
    return Pool(
        PoolConfig(
            entry=EntrySpec(bytes_per_layer=WIDTH),
            num_layers=GROUPS,
            layers_per_group=1,
            layout=Tiered(gpu_slots=24, cpu_slots=60, policy=policy),
            validate=validate,
            engine_addresses=engine_addresses,
        )
    )


@skip_under_debug  # ULAKV_DEBUG validates every call: one status read each, by design
@pytest.mark.parametrize("policy", [ExactLRU(), PBLRU(4)], ids=["lru", "pblru"])
def test_a_decode_step_of_many_groups_reads_nothing_back(policy) -> None:
    pool = _pool(policy)
    kv = SparseKV(pool, max_batch=3, top_k=6)
    gen = torch.Generator().manual_seed(5)
    seqs = [pool.admit(9) for _ in range(3)]
    for layer in range(GROUPS):
        for seq in seqs:
            kv.write(layer, seq.addresses, random_rows(gen, 9, WIDTH))
    steps, per_step = 2, []
    for _ in range(steps):
        new = [pool.extend(seq) for seq in seqs]  # admission is the host's: outside the count
        tokens = torch.cat(new)
        rows = random_rows(gen, tokens.numel(), WIDTH)
        picks = torch.stack(
            [seq.addresses[torch.randperm(seq.addresses.numel(), generator=gen)[:6]] for seq in seqs]
        )
        counter = _ReadBackCounter()
        with counter:
            for layer in range(GROUPS):
                kv.write(layer, tokens, rows)
                kv.prepare(layer, picks)
        per_step.append(counter.seen)
    assert all(len(seen) <= 1 for seen in per_step), per_step
    pool.check()  # and nothing was refused


@skip_under_debug
@pytest.mark.parametrize("call", ["prepare", "write", "admit_addresses", "release_addresses"])
def test_a_refusal_is_raised_by_the_next_call_naming_its_kind(call: str) -> None:
    pool = _pool(ExactLRU(), engine_addresses=48)
    live = torch.arange(10)
    pool.admit_addresses(live)
    pool.write(0, live, random_rows(torch.Generator().manual_seed(1), 10, WIDTH))
    before = pool.state_dict()
    dead = torch.tensor([40])
    if call == "prepare":
        pool.prepare(0, torch.cat([live[:3], dead]).view(1, 4))
    elif call == "write":
        pool.write(0, torch.cat([live[:2], dead]), random_rows(torch.Generator(), 3, WIDTH))
    elif call == "admit_addresses":
        pool.admit_addresses(live[:2])  # live already
    else:
        pool.release_addresses(dead)
    assert_same_state(before, pool.state_dict(), ignore=("pending",))
    state = "live already" if call == "admit_addresses" else "not live"
    # A prepare or write names its layer group; an engine admit or release acts on every group.
    where = {"prepare": " of layer group 0", "write": " to layer group 0"}.get(call, "")
    with pytest.raises(InvalidAddressError, match=rf"an earlier {call}{where} \(refused.*{state}"):
        pool.prepare(0, live[:4].view(1, 4))
    pool.prepare(0, live[:4].view(1, 4))  # raised once: the pool goes on
    pool.check()


def test_a_report_of_several_refusals_names_the_latest_and_counts_them() -> None:
    """The host side alone: reports are raised once each, with the refusals since the last raised."""
    report = torch.zeros(1, dtype=torch.int64)
    deferred = DeferredStatus([report])
    assert deferred.take() is None
    report[0] = (2 << 32) | (int(K.CALL_PREPARE) << 8) | int(K.ST_TOO_LARGE)
    refusal = deferred.take()
    assert refusal == Refusal(status=int(K.ST_TOO_LARGE), call="prepare", group=0, calls=2)
    assert "the latest of 2 refused calls" in refusal.describe()
    assert deferred.take() is None, "raised once"
    report[0] = (3 << 32) | (int(K.CALL_WRITE) << 8) | int(K.ST_BAD_ADDRESS)
    deferred.forget()  # a synchronising check raised it
    assert deferred.take() is None


def test_a_report_names_the_layer_group_of_the_newest_refusal() -> None:
    """One word a group: the newest count names the call and its group, every newer word's bits
    are OR-ed and the calls counted from the last raised; the count wraps at 32 bits."""
    report = torch.zeros(4, dtype=torch.int64)
    deferred = DeferredStatus([report])
    report[1] = (1 << 32) | (int(K.CALL_WRITE) << 8) | int(K.ST_DUPLICATE)
    report[3] = (3 << 32) | (int(K.CALL_PREPARE) << 8) | int(K.ST_TOO_LARGE)
    refusal = deferred.take()
    assert refusal == Refusal(int(K.ST_DUPLICATE | K.ST_TOO_LARGE), "prepare", group=3, calls=3)
    assert refusal.describe().startswith("an earlier prepare of layer group 3 (refused, the latest of 3")
    report[2] = (4 << 32) | (int(K.CALL_WRITE) << 8) | int(K.ST_BAD_ADDRESS)
    assert deferred.take() == Refusal(int(K.ST_BAD_ADDRESS), "write", group=2, calls=1)

    def word(count: int, call, status) -> int:  # as the device packs it: an int64, negative past 2**31
        packed = (count << 32) | (int(call) << 8) | int(status)
        return packed - (1 << 64) if packed >= 1 << 63 else packed

    # The last count wrapped past 2**32 and is still the newer one.
    for count, calls in ((0x7FFFFFF0, 0x7FFFFFEC), (0xEFFFFFF0, 0x70000000), (2, 0x10000012)):
        report[0] = word(count, K.CALL_ADMIT, K.ST_FULL)
        assert deferred.take() == Refusal(int(K.ST_FULL), "admit_addresses", group=None, calls=calls)
    assert deferred.take() is None


def test_a_word_read_after_a_newer_one_adds_no_call() -> None:
    """The host reads a context's words one after another while the device may store: group 1's
    count 3 seen before group 0's count 2 (stored first, read late). Count 3 was raised as 3 calls,
    so count 2, seen later, was among them: it adds nothing, and the count never goes back."""
    report = torch.zeros(2, dtype=torch.int64)
    deferred = DeferredStatus([report])
    report[1] = (3 << 32) | (int(K.CALL_WRITE) << 8) | int(K.ST_DUPLICATE)
    assert deferred.take() == Refusal(int(K.ST_DUPLICATE), "write", group=1, calls=3)
    report[0] = (2 << 32) | (int(K.CALL_PREPARE) << 8) | int(K.ST_TOO_LARGE)
    assert deferred.take() is None
    report[0] = (4 << 32) | (int(K.CALL_PREPARE) << 8) | int(K.ST_BAD_ADDRESS)
    assert deferred.take() == Refusal(int(K.ST_BAD_ADDRESS), "prepare", group=0, calls=1)


@skip_under_debug
def test_check_raises_a_refusal_once_and_the_next_call_does_not_again() -> None:
    pool = _pool(ExactLRU())
    seq = pool.admit(5)
    pool.prepare(0, torch.tensor([[seq.addresses[0].item(), 99]]))
    with pytest.raises(InvalidAddressError, match=r"an earlier prepare of layer group 0 \(refused"):
        pool.check()
    pool.prepare(0, seq.addresses.view(1, 5))  # not raised again from the report
    pool.check()


def test_a_validating_pool_raises_at_the_call_and_never_again_from_the_report() -> None:
    pool = _pool(ExactLRU(), validate=True)
    seq = pool.admit(5)
    with pytest.raises(InvalidAddressError, match="prepare"):
        pool.prepare(0, torch.tensor([[seq.addresses[0].item(), 99]]))
    pool.prepare(0, seq.addresses.view(1, 5))
    pool.check()


@triton.jit
def _report_kernel(ctl_ptr, report_ptr, status_ptr, CALL: tl.constexpr):
    K.report_refusal(ctl_ptr, report_ptr, tl.load(status_ptr), CALL)


def test_the_report_word_kernel_and_twin_agree() -> None:
    """``report_refusal`` against its twin: counted and stored only for a refusal, packed the same."""
    for status, call in ((0, 1), (4, 1), (1, 2), (16, 3), (3, 4)):
        ctl = torch.zeros(K.CTL_WORDS, dtype=torch.int64)
        ctl[int(K.E_REFUSALS)] = 0xFFFFFFFF  # the count wraps at 32 bits
        report = torch.full((1,), -7, dtype=torch.int64)  # poisoned: a refusal overwrites it whole
        ctl_ref, report_ref = ctl.clone(), report.clone()
        _report_kernel[(1,)](ctl, report, torch.tensor([status], dtype=torch.int64), call)
        K.report_refusal_reference(ctl_ref, report_ref, status, call)
        assert torch.equal(ctl, ctl_ref) and torch.equal(report, report_ref), (status, call)
        assert int(report[0]) == ((call << 8) | status if status else -7)  # count 0 after the wrap
