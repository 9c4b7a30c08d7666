"""The main job runs end to end at a reduced size: three systems under one memory budget, every
system's outputs verified against a dense run (the demo raises on any mismatch)."""

from __future__ import annotations

import pytest

from ulakv.demo import main, run


def test_demo_compares_three_systems_under_one_budget(capsys) -> None:
    rows = run(topk=8, steps=1)
    out = capsys.readouterr().out
    assert "distinct / slots at peak" in out and "outputs verified" in out
    for name in ("GPU-only", "CPU offload", "ulakv"):
        assert any(line.startswith(name) and "bit-exact vs dense" in line for line in out.splitlines())
    gpu, offload, ours = rows["GPU-only"], rows["CPU offload"], rows["ulakv"]
    # The budget (top-k 8): G = 96 GPU rows, Q = 16 (2 x top-k), C = 320 CPU rows; requests of
    # 36-39 prompt + 2 new tokens. GPU-only fits 2 (3 x 38 > 96); the offload baseline has G // Q
    # = 6 buffers (its CPU copy would hold 7); ulakv holds G + C - S >= C = 320 tokens: at least 7.
    assert gpu["admitted"] == 2 and offload["admitted"] == 6
    assert ours["admitted"] >= 7 > offload["admitted"]
    # One home per entry (GPU-only, ulakv); the baseline's GPU rows are copies of CPU rows.
    assert gpu["distinct"] == gpu["slots"] and ours["distinct"] == ours["slots"]
    assert offload["distinct"] < offload["slots"]
    assert gpu["hit_rate"] == 1.0 and gpu["bytes_in"] == 0 and ours["bytes_in"] > 0


def test_demo_reads_its_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        main(["--steps", "0"])  # refused before any work: argv, not sys.argv, was parsed
