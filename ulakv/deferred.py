"""Refusals raised without a host sync, and without a copy or an event a call.

A pool that does not validate each call (the CUDA default) cannot read a call's status back without
waiting for the GPU. A refused ``prepare``, ``write``, ``admit_addresses`` or ``release_addresses``
changes nothing on the device and returns ``-1`` for every slot; its status bits are OR-ed into
the control word ``E_PENDING``, and the one program that decided the refusal also *reports* it:
one aligned 8-byte store, ``refusals << 32 | call << 8 | status``, into its layer group's word of
host memory mapped for the device (``TieredState.report``, ``kernels.common.report_refusal``).
``refusals`` counts the call context's refused calls, so the host tells a new report from one it
has raised, and the word it was found in names the group (an error names the call and the group).

Each later call reads that word as plain memory: no copy, no CUDA event, no wait, nothing launched.
A report the host has not raised yet is raised there, to that call's caller, naming the kind of call
refused (and how many were refused since the last one raised). So an error surfaces at the first
call made after the refusing kernel's store reached host memory, usually the next step's, and at
the latest at the next synchronising call (``check``, ``stats``, ``read``), which waits for the
device and then reads the words. On the CPU the store is immediate: the very next call raises.
Inside a CUDA-graph capture nothing is looked at (the store is captured with its kernel; replays
report their own refusals).

The host writes no device memory here. What is new is told by the counts in the words, never by
clearing a device word: ``E_PENDING`` is read-modify-written by each context's planning program on
that context's stream, and a clear launched from another stream could land between the read and
the write, so that an already raised refusal came back (``E_PENDING`` stays a sticky OR, kept for
inspection, which no raise depends on).

Before this word, every non-validating call copied ``E_PENDING`` to pinned memory and recorded an
event behind the copy: about 123 copies and events a decode step of a 61-layer model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels import common as K


@dataclass(frozen=True)
class Refusal:
    """A refused call the host has learnt of: its status bits (``ST_*``), the kind of call
    (``prepare``, ``write``, ``admit_addresses``, ``release_addresses``), the layer group of a
    ``prepare`` or ``write`` (``None`` for the others, which act on addresses in every group) and how
    many calls were refused since the last refusal raised (this one included; the bits are those of
    each group's latest refused call)."""

    status: int
    call: str
    group: int | None = None
    calls: int = 1

    def describe(self) -> str:
        """``an earlier write to layer group 2 (refused: ...)`` and the count, for an error message."""
        more = f", the latest of {self.calls} refused calls" if self.calls > 1 else ""
        slots = ": its slots were -1" if self.call == "prepare" else ""
        where = "" if self.group is None else f" {_PREPOSITION[self.call]} layer group {self.group}"
        return f"an earlier {self.call}{where} (refused{more}{slots})"


_PREPOSITION = {"prepare": "of", "write": "to"}
_COUNT_MASK = 0xFFFFFFFF  # E_REFUSALS wraps at 2**32


def _ahead(count: int, seen: int) -> int:
    """How many refusals ``count`` is past ``seen``, modulo 2**32, as a signed difference: at most
    zero for a count already raised."""
    return ((count - seen + (1 << 31)) & _COUNT_MASK) - (1 << 31)


class DeferredStatus:
    """The host side of one pool's refusal reports: one word per layer group per call context
    (``TieredRunner``), each context with its own count; ``reports`` holds each context's words
    (a context's words are those of one count: its call context's ``E_REFUSALS``)."""

    def __init__(self, reports: Sequence[torch.Tensor], device: torch.device | None = None) -> None:
        # The pool's device, not the words' (host memory beside a GPU): nothing is looked at while
        # a CUDA graph is being captured on it.
        self._cuda = device is not None and device.type == "cuda"
        # Read as plain memory: no tensor op, no copy, no sync (a meta pool reports nothing).
        self._words = [r.numpy() for r in reports if r.device.type != "meta"]
        self._looked = [w.tolist() for w in self._words]  # each context's words as last looked at
        # each context's count when last raised or forgotten: what its words hold now
        self._seen = [max((w >> 32) & _COUNT_MASK for w in words) for words in self._looked]

    def take(self) -> Refusal | None:
        """The refusals reported and not raised yet, if their stores have reached host memory:
        marked seen (on the host only: nothing is written to the device). Reports of several
        groups or contexts at once come back as one: all counted, their bits OR-ed, the call and
        group named those of the first context's latest report."""
        if not self._words or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return None
        found: Refusal | None = None
        for i, words in enumerate(self._words):
            latest = self._latest(i, words.tolist())
            if latest is None:
                continue
            if found is None:
                found = latest
            else:
                found = Refusal(
                    found.status | latest.status, found.call, found.group, found.calls + latest.calls
                )
        return found

    def _latest(self, i: int, words: list[int]) -> Refusal | None:
        """Context ``i``'s refusals since it was last looked at. A word is stored only by a refused
        call, with the context's count, so a word that changed holds its group's latest refusal. The
        words are not read at one instant: a word stored after an earlier one was read, but with a
        lower count than one already raised, was counted then; it adds its bits, never a call."""
        looked, self._looked[i] = self._looked[i], words
        if words == looked:
            return None
        seen, newest, status, group_of_newest = self._seen[i], 0, 0, 0
        for group, (word, before) in enumerate(zip(words, looked, strict=True)):
            if word != before:
                status |= word & 0xFF
                ahead = _ahead(word >> 32, seen)
                if ahead > newest:
                    newest, group_of_newest = ahead, group
        if newest == 0:  # only refusals already counted in one raised
            return None
        word = words[group_of_newest]
        self._seen[i] = (word >> 32) & _COUNT_MASK
        call = K.CALL_NAMES.get((word >> 8) & 0xFF, "call")
        group = group_of_newest if call in _PREPOSITION else None
        return Refusal(status=status, call=call, group=group, calls=newest)

    def forget(self) -> None:
        """After a call's own status was read and raised (a validating call): every report so far
        is seen."""
        for i, words in enumerate(self._words):
            self._latest(i, words.tolist())
