"""The main job runs end to end (short): admission refuses cleanly, every read is verified."""

from __future__ import annotations

from ulakv import PBLRU
from ulakv.demo import run


def test_demo_runs_and_verifies(capsys) -> None:
    result = run(steps=2, seed=1, policy=PBLRU(8))
    out = capsys.readouterr().out
    assert "one more is refused" in out and "4 a group-step" in out
    assert result["checked"] > 0 and 0 < result["hit_rate"] < 1
