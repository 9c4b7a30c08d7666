"""``ulakv capacity --systems sglang``: SGLang as it serves DSA models (GPU only, HiSparse, DCP with
its index keys on every rank) beside what its DCP adapter builds over ulakv's local mode."""

from __future__ import annotations

import contextlib
import io

import pytest

from ulakv.capacity import SGLANG_SYSTEMS, Scenario, default_selection_shape, fit_systems
from ulakv.cli import main
from ulakv.presets import HARDWARE, MODELS


def _plan(model: str, mode: str, systems=(*SGLANG_SYSTEMS, "dcp", "ulakv", "ulakv_local")):
    scenario = Scenario(MODELS[model], HARDWARE["h200"], mode, True, shape=default_selection_shape(True))
    return {name: p.admitted for name, p in fit_systems(scenario, systems).systems.items()}


@pytest.mark.parametrize("model", ["glm-5.3", "deepseek-v3.2"])
def test_sglang_dcp_over_ulakv_admits_more_and_its_index_keys_cost_what_they_cost(model) -> None:
    tp = _plan(model, "TP")
    assert tp["sglang_dcp_ulakv"] > tp["sglang_dcp"] > tp["gpu_only"]
    # SGLang keeps every token's index keys on every rank: less than DCP with striped keys, alike
    # with ulakv beneath (the keys, not the latent rows, bound a rank's GPU).
    assert tp["sglang_dcp"] <= tp["dcp"] and tp["sglang_dcp_ulakv"] < tp["ulakv_local"]
    dp = _plan(model, "DP")  # under DP attention a DCP group is one rank
    assert dp["sglang_dcp"] == dp["gpu_only"] and dp["sglang_dcp_ulakv"] == dp["ulakv"]


def test_the_cli_prints_the_sglang_table() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["capacity", "--systems", "sglang", "--gpu", "h200", "--mode", "TP", "--spec", "on"]) == 0
    header, row = out.getvalue().splitlines()[:2]
    assert header.split()[1:5] == list(SGLANG_SYSTEMS)
    assert row.startswith("H200 TP spec on") and row.split()[-1].endswith("x")
