"""The two figures: admitted requests per configuration, and hit rate against GPU capacity.

matplotlib is an optional extra (``pip install ulakv[plot]``); nothing else imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

SYSTEM_LABELS = {
    "gpu_only": "GPU only (SGLang)",
    "cpu_offload": "CPU offload (HiSparse)",
    "dcp": "decode context parallel (vLLM, SGLang)",
    "ulakv": "ulakv (fetch)",
    "ulakv_local": "ulakv (local)",
}
COLORS = {
    "gpu_only": "#9e9e9e",
    "cpu_offload": "#e08a3c",
    "dcp": "#5a9a4f",
    "ulakv": "#2f6db5",
    "ulakv_local": "#16386b",
}


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("plots need matplotlib: pip install 'ulakv[plot]'") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def admitted_bars(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """Grouped bars: one group per configuration, one bar per system (``ulakv capacity`` rows)."""
    plt = _pyplot()
    configs = list(dict.fromkeys((r["gpu"], r["mode"], r["spec"]) for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    value = {(r["gpu"], r["mode"], r["spec"], r["system"]): r["admitted"] for r in rows}
    fig, ax = plt.subplots(figsize=(12, 4.6))
    width = 0.84 / len(systems)
    for j, system in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(configs))]
        ys = [value[(*c, system)] for c in configs]
        bars = ax.bar(xs, ys, width, label=SYSTEM_LABELS.get(system, system), color=COLORS.get(system))
        ax.bar_label(bars, fontsize=6, padding=1, rotation=90)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{g} {m}\nspec {'on' if s else 'off'}" for g, m, s in configs], fontsize=8)
    ax.set_yscale("symlog", linthresh=1)  # log above 1, and a system that admits 0 still shows
    ax.set_ylim(top=4 * max(value.values(), default=1))  # room for the labels above the bars
    ax.set_ylabel("admitted requests (8 GPUs, log scale)")
    ax.set_title(title, fontsize=10)
    # One row of systems under the axis: inside, it would cover the tallest bars.
    ax.legend(fontsize=8, frameon=False, ncol=len(systems), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def hit_rate_curves(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """Hit rate against GPU capacity (multiples of one step's working set), a line per system
    and policy, and the Belady bound dashed (``ulakv replay`` rows)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        mine = [r for r in rows if r["label"] == label and r["hit_rate"] is not None]
        mine.sort(key=lambda r: r["x"])
        if mine:
            ax.plot([r["x"] for r in mine], [100 * r["hit_rate"] for r in mine], marker="o", label=label)
    bound = sorted({(r["x"], r["belady_hit_rate"]) for r in rows if r["belady_hit_rate"] is not None})
    ax.plot([x for x, _ in bound], [100 * b for _, b in bound], "k--", label="Belady (OPT) bound")
    ax.set_xlabel("GPU slots a layer group (x one step's working set)")
    ax.set_ylabel("GPU hit rate (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
