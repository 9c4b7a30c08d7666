"""The main job runs end to end as ``make demo`` runs it: three systems under one memory budget, every
system's outputs verified against a dense run (the demo raises on any mismatch), and its output is
the README's sample."""

from __future__ import annotations

from pathlib import Path

import pytest

from ulakv.demo import main, run

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_sample() -> str:
    """The README's sample of ``make demo``'s output: the code block after "prints exactly this"."""
    text = README.read_text()
    start = text.index("```\n", text.index("prints exactly this")) + len("```\n")
    return text[start : text.index("```\n", start)]


def test_demo_prints_the_readmes_sample_and_compares_three_systems_under_one_budget(capsys) -> None:
    """``make demo`` (``ulakv demo``: ``run()`` with its defaults) prints the README's sample, line
    for line; if the demo's figures change, paste its new output into the README."""
    rows = run()
    out = capsys.readouterr().out
    assert out == readme_sample(), "the README's demo sample differs from what `ulakv demo` prints"
    for name in ("GPU-only", "CPU offload", "ulakv"):
        assert any(line.startswith(name) and "bit-exact vs dense" in line for line in out.splitlines())
    gpu, offload, ours = rows["GPU-only"], rows["CPU offload"], rows["ulakv"]
    # The budget (top-k 16): G = 192 GPU rows, Q = 32 (2 x top-k), C = 640 CPU rows; prompts of
    # 72-78 + 5 new tokens. GPU-only fits 2 (3 x 78 > 192); the offload baseline has G // Q = 6
    # buffers; ulakv holds G + C - S = 651 tokens: 8.
    assert (gpu["admitted"], offload["admitted"], ours["admitted"]) == (2, 6, 8)
    # One home per entry (GPU-only, ulakv); the baseline's GPU rows are copies of CPU rows.
    assert gpu["distinct"] == gpu["slots"] and ours["distinct"] == ours["slots"]
    assert offload["distinct"] < offload["slots"]
    assert gpu["hit_rate"] == 1.0 and gpu["bytes_in"] == 0 and ours["bytes_in"] > 0


def test_demo_reads_its_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        main(["--steps", "0"])  # refused before any work: argv, not sys.argv, was parsed
