"""Benchmarks run where the tests run: on a GPU natively, elsewhere under the Triton interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Every benchmark's ``extra_info`` as one markdown table per group, side by side (what
    ``RESULTS.md`` quotes), after pytest-benchmark's own timing table."""
    session = getattr(config, "_benchmarksession", None)
    benches = getattr(session, "benchmarks", None) or []
    groups: dict[str, list] = {}
    for bench in benches:
        if bench.extra_info:
            groups.setdefault(bench.group or "", []).append(bench)
    for group, members in groups.items():
        keys = sorted({k for b in members for k in b.extra_info})
        terminalreporter.write_line(f"\n### {group or 'ungrouped'}\n")
        terminalreporter.write_line("| benchmark | " + " | ".join(keys) + " |")
        terminalreporter.write_line("|---" * (len(keys) + 1) + "|")
        for b in members:
            cells = [str(b.extra_info.get(k, "")) for k in keys]
            terminalreporter.write_line(f"| {b.name} | " + " | ".join(cells) + " |")
