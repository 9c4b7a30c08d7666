"""The pool's GPU time per decode step, estimated, beside the model's own step and HiSparse's
planned copy: how far from a 5 % share the pool is.

    python benchmarks/budget.py                 # batch 64 and 256 (interpreter counts: slow)
    python benchmarks/budget.py --batch 16      # a quicker look

No GPU measures these yet, so each figure is an estimate from what the interpreter counts and
from the H200's published rates, and says which:

- **critical path**: the busiest programs' memory operations of one layer's write (one new token
  a request) and prepare (batch x 3 query positions x top-2048, a DSA-shaped trace, the GPU full:
  ``benchmarks/critical_path.py``), priced at ``US_PER_OP`` each. Operations of one program that
  do not depend on each other overlap on a GPU, so this is an upper bound;
- **bytes**: the misses' rows in and the victims' rows out over PCIe (``PCIE_BPS`` each way) and
  the slots through HBM (``HBM_BPS``);
- **launches**: the step's launches at ``US_PER_LAUNCH`` of GPU-side gap each (a captured step
  pays no host time; an eager one pays about 5 us of host time a launch on top);
- **the model's step**, a memory-bound lower bound per GPU of 8 (DP attention, expert parallel
  MoE, every expert read once a step at these batches): the FP8 weights' share, the selected
  latent rows, and the indexer's keys over the whole context (the workload's 96 K tokens mean);
- **HiSparse**: its planned-copy kernel, 29 us a layer at batch 100 with 2 misses a request on an
  H200 (the figure the issue that asked for this table gives), times the layers.

One-layer groups (SGLang runs DSA models with an indexer a layer): 61 calls of each kind a step
for DeepSeek-V3.2, 78 for GLM-5.3 (which shares one top-k across 4 layers: 20 selections a step
once layer groups follow the model, the second GLM-5.3 row). The "one plan" columns price each
layer's write and prepare as one call (``prepare(..., new=NewRows(...))``): its critical path and
its launches (its new tokens and selection read in place: no copy); the bytes are the two calls'.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from critical_path import measure

from ulakv import PBLRU, ExactLRU
from ulakv.presets import GB, MODELS

US_PER_OP = 1.0  # a dependent global-memory operation, microseconds (the figure)
US_PER_LAUNCH = 1.0  # GPU-side gap between dependent kernels, microseconds
HOST_US_PER_LAUNCH = 5.0  # an eager launch's host time with 45-60 arguments, microseconds
HBM_BPS = 4.8e12  # H200 HBM3e
PCIE_BPS = 50e9  # PCIe 5.0 x16, one way, what pinned copies reach
HISPARSE_US_PER_LAYER = 29.0
CONTEXT_MEAN = 96 * 1024  # the workload: 64 K - 128 K input tokens
RANKS = 8
LAUNCHES_PER_LAYER = 9  # write 4 (claim, classify, decide, apply) + prepare 4-5


def model_step_ms(preset, batch: int) -> float:
    """A memory-bound lower bound of one decode step on one GPU of 8, ms."""
    weights = preset.weights_bytes / RANKS
    latent = batch * 3 * preset.topk * preset.latent_bytes * preset.num_layers  # 3 query positions
    index_layers = -(-preset.num_layers // preset.indexer_every)
    keys = batch * CONTEXT_MEAN * preset.index_key_bytes * index_layers
    return (weights + latent + keys) / HBM_BPS * 1e3


def pool_layer_us(counts: dict, row_bytes: int, one_plan: bool = False) -> dict:
    """One layer's write and prepare (``one_plan``: as one call): critical path, bytes and launch
    gaps, microseconds."""
    ops = counts["critical_path"] + counts["write_critical_path"]
    launches = LAUNCHES_PER_LAYER
    if one_plan:
        ops, launches = counts["one_plan_critical_path"], counts["one_plan_launches"]
    moved = (counts["misses"] + counts["evicted"]) * row_bytes / PCIE_BPS * 1e6
    return {
        "ops": ops,
        "ops_us": ops * US_PER_OP,
        "pcie_us": moved,
        "launch_us": launches * US_PER_LAUNCH,
    }


def rows(batches: list[int]) -> list[dict]:
    out = []
    for batch in batches:
        for policy in (ExactLRU(), PBLRU(8)):
            counts = measure(batch, policy)
            for key, preset, calls in (
                ("deepseek-v3.2", MODELS["deepseek-v3.2"], 61),
                ("glm-5.3", MODELS["glm-5.3"], 78),
                ("glm-5.3", MODELS["glm-5.3"], 20),
            ):
                layer = pool_layer_us(counts, preset.latent_bytes)
                pool_ms = calls * (layer["ops_us"] + layer["pcie_us"] + layer["launch_us"]) / 1e3
                one = pool_layer_us(counts, preset.latent_bytes, one_plan=True)
                one_ms = calls * (one["ops_us"] + one["pcie_us"] + one["launch_us"]) / 1e3
                model_ms = model_step_ms(preset, batch)
                out.append(
                    {
                        "model": preset.name,
                        "batch": batch,
                        "policy": str(policy),
                        "calls": calls,
                        "ops_a_layer": layer["ops"],
                        "misses_a_layer": counts["misses"],
                        "pool_ms": pool_ms,
                        "of_which_pcie_ms": calls * layer["pcie_us"] / 1e3,
                        "eager_host_ms": calls * LAUNCHES_PER_LAYER * HOST_US_PER_LAUNCH / 1e3,
                        "model_ms": model_ms,
                        "share": pool_ms / model_ms,
                        "one_plan_ops": one["ops"],
                        "one_plan_ms": one_ms,
                        "one_plan_share": one_ms / model_ms,
                        "hisparse_ms": preset.num_layers * HISPARSE_US_PER_LAYER / 1e3,
                        "key": key,
                    }
                )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    print(
        "| model | batch | policy | selections a step | ops a layer (write + prepare) | misses a layer | "
        "pool ms a step | of which PCIe | eager host ms | model step ms (lower bound) | pool share | "
        "to 5 % | HiSparse copy ms | one plan: ops a layer | one plan: pool ms | one plan: share |"
    )
    print("|---" * 16 + "|")
    for r in rows(args.batch):
        print(
            f"| {r['model']} | {r['batch']} | {r['policy']} | {r['calls']} | {r['ops_a_layer']} | "
            f"{r['misses_a_layer']} | {r['pool_ms']:.2f} | {r['of_which_pcie_ms']:.2f} | "
            f"{r['eager_host_ms']:.2f} | {r['model_ms']:.1f} | {100 * r['share']:.1f} % | "
            f"x{r['share'] / 0.05:.1f} | {r['hisparse_ms']:.2f} | {r['one_plan_ops']} | "
            f"{r['one_plan_ms']:.2f} | {100 * r['one_plan_share']:.1f} % |",
            flush=True,
        )
    print(
        f"\n(weights: {MODELS['deepseek-v3.2'].weights_bytes / GB:.0f} GB and "
        f"{MODELS['glm-5.3'].weights_bytes / GB:.0f} GB FP8 over {RANKS} GPUs)"
    )


if __name__ == "__main__":
    main()
