"""Layer groups from a DSA model's own configuration: the layers that share one top-k.

DSA models compute a fresh top-k at some layers and reuse the previous layer's at the others
(SGLang's ``dsa_layer_skips_topk``; GLM-5.2/5.3 reuse it in 57 of 78 layers). Each fresh layer
starts a ulakv layer group (``PoolConfig.group_starts``): the group is prepared once a step, with
one residency, and its later layers read the same slots. SGLang's rules, in its order:

1. ``indexer_types``: a layer whose type is ``"shared"`` reuses;
2. ``cli_factor > 1`` (LongCat): fresh every ``cli_factor`` layers;
3. ``index_topk_pattern``: a layer marked ``"S"`` reuses;
4. ``index_topk_freq`` with ``index_skip_topk_offset``: fresh where
   ``max(layer - offset + 1, 0) % freq == 0`` (offset unset: ``max(layer - 1, 0) % freq == 0``).

``tests/test_sglang_layer_groups.py`` holds this to SGLang's own function, read from the pinned
wheel's source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidInputError


def skips_topk(config: Any, layer: int) -> bool:
    """Whether ``layer`` reuses the previous layer's top-k under ``config`` (a Hugging Face model
    config, or anything with its attributes)."""
    types = getattr(config, "indexer_types", None)
    if types is not None:
        return 0 <= layer < len(types) and types[layer] == "shared"
    cli_factor = getattr(config, "cli_factor", 1) or 1
    if cli_factor > 1:
        return layer % cli_factor != 0
    pattern = getattr(config, "index_topk_pattern", None)
    if pattern is not None:
        return layer < len(pattern) and pattern[layer] == "S"
    freq = getattr(config, "index_topk_freq", 1) or 1
    offset = getattr(config, "index_skip_topk_offset", None)
    if offset is not None:
        return max(layer - offset + 1, 0) % freq != 0
    return max(layer - 1, 0) % freq != 0


def group_starts_from_skips(skips: Sequence[bool]) -> tuple[int, ...]:
    """``PoolConfig.group_starts`` from one flag a layer (SGLang's ``skip_topk_layers``: True where
    the layer reuses the previous layer's top-k). The first layer always starts a group: a pipeline
    stage that begins on a reusing layer gets its top-k from the stage before, which its own pool
    has not prepared."""
    if not skips:
        raise InvalidInputError("group_starts_from_skips: no layers")
    return tuple(layer for layer, skip in enumerate(skips) if layer == 0 or not skip)


def group_starts_from_config(config: Any, start_layer: int, end_layer: int) -> tuple[int, ...]:
    """``PoolConfig.group_starts`` for the layers ``[start_layer, end_layer)`` a rank holds (pipeline
    stages hold a range), numbered from 0 within the range."""
    return group_starts_from_skips([skips_topk(config, layer) for layer in range(start_layer, end_layer)])
