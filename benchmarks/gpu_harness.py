"""The one harness of the GPU scripts (``gpu_suite.py``, ``sglang_gpu_check.py``): a run is a list of
named sections in suite order, ``--only`` picks some by name, and each ends as one
:class:`SectionResult`: PASS, FAIL (it raised; :class:`Failed` says what it found, anything else is
reported with its type) or SKIP (it raised :class:`Skip`: it cannot run on this machine, for a
missing package or GPU, which is not a failure). Standard library only: a script must import, and
answer ``--help``, where neither torch's CUDA build nor SGLang is installed.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


class Skip(Exception):
    """The section cannot run on this machine (a package or a GPU it needs is absent); says why."""


class Failed(Exception):
    """The section ran and found something wrong; the message says what."""


@dataclass
class SectionResult:
    """How one section ended: ``status`` PASS, FAIL or SKIP, a one-line ``reason``, its wall
    seconds, what it recorded (``details``) and, for a FAIL, the traceback (``error``)."""

    name: str
    status: str
    reason: str
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def run_section(name: str, section: Callable[[dict[str, Any]], Any]) -> tuple[SectionResult, Any]:
    """Run ``section(details)``; whatever it raises becomes its FAIL (or SKIP), never the run's end.
    Returns the result and what the section returned (None unless it passed). A passing section's
    reason is what it returned when that is a string."""
    details: dict[str, Any] = {}
    error, value = None, None
    start = time.perf_counter()
    try:
        value = section(details)
        status, reason = "PASS", value if isinstance(value, str) else ""
    except Skip as exc:
        status, reason = "SKIP", str(exc)
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        head = lines[0] if lines else ""
        status = "FAIL"
        reason = head if isinstance(exc, Failed) else f"{type(exc).__name__}: {head}"
        error = traceback.format_exc()
    return SectionResult(name, status, reason, round(time.perf_counter() - start, 3), details, error), value


def section_names(known: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse ``type`` for ``--only``: comma-separated names of ``known`` sections."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown section(s) {unknown}; choose from {', '.join(known)}")
        return names

    return parse


def in_suite_order(wanted: Sequence[str] | None, known: Sequence[str]) -> list[str]:
    """The sections to run: ``wanted`` (all when None), in the suite's order."""
    return [name for name in known if wanted is None or name in wanted]


def result_rows(results: Sequence[SectionResult]) -> list[str]:
    """A markdown table of the results, for ``benchmarks/RESULTS.md``."""
    rows = ["| section | result | seconds | reason |", "|---|---|---:|---|"]
    rows += [f"| {r.name} | {r.status} | {r.seconds:.2f} | {r.reason.replace('|', '/')} |" for r in results]
    return rows
