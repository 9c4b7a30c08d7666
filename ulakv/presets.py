"""The models and machines ``ulakv capacity`` plans for: each preset's sizes and where they come
from (``source``), as the capacity model and the benchmarks read them.

``MODELS``: GLM-5, GLM-5.3 and DeepSeek-V3.2 (layers, latent and index widths, indexer layers,
weights); ``HARDWARE``: an H200 and a B300 (GPU memory, the published CPU budget a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class ModelPreset:
    """What the capacity model needs of a model: KV and index-key bytes, layers, attention dimensions
    (DP attention replicates the attention weights), checkpoint size."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    index_heads: int
    index_dim: int
    indexer_every: int  # one indexer per this many layers; the layers it serves share one selection
    topk: int
    weights_bytes: int  # the FP8 checkpoint, MTP layer included
    source: str
    latent_bytes: int = 656  # FP8 latent: 512 fp8 + 4 fp32 scales + 64 bf16 rope
    index_key_bytes: int = 132  # 128 fp8 + one fp32 scale

    def kv_layers(self, spec: bool) -> int:
        """Layers with latent KV: the decoder's, plus the MTP layer's when it drafts."""
        return self.num_layers + int(spec)

    def index_layers(self, spec: bool) -> int:
        return -(-self.num_layers // self.indexer_every) + int(spec)

    def attention_params_per_layer(self) -> int:
        """MLA projections (q_a, q_b, kv_a, kv_b, o) and the indexer's (wq_b, wk, head weights)."""
        h, n = self.hidden, self.heads
        mla = (
            h * self.q_lora_rank
            + self.q_lora_rank * n * (self.qk_nope_dim + self.qk_rope_dim)
            + h * (self.kv_lora_rank + self.qk_rope_dim)
            + self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
            + n * self.v_head_dim * h
        )
        indexer = (
            self.q_lora_rank * self.index_heads * self.index_dim + h * self.index_dim + h * self.index_heads
        )
        return mla + indexer

    def weights(self, spec: bool) -> int:
        """Checkpoint bytes loaded: without speculation the MTP layer (one decoder layer's share,
        ``weights / (layers + 1)``) stays on disk."""
        return self.weights_bytes if spec else self.weights_bytes - self.mtp_bytes

    @property
    def mtp_bytes(self) -> int:
        return self.weights_bytes // (self.num_layers + 1)

    def attention_weights(self, spec: bool) -> int:
        """FP8 attention weights of every layer (1 byte a parameter; scales left out)."""
        return self.attention_params_per_layer() * self.kv_layers(spec)


_GLM5 = dict(
    num_layers=78,
    hidden=6144,
    heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_dim=192,
    qk_rope_dim=64,
    v_head_dim=256,
    index_heads=32,
    index_dim=128,
    topk=2048,
    weights_bytes=715 * GB,
)
MODELS = {
    "glm-5": ModelPreset(
        name="GLM-5",
        indexer_every=1,
        source="GLM-5 config (GlmMoeDsaConfig defaults); 715 GB FP8 checkpoint (docs/design.md, section 7)",
        **_GLM5,
    ),
    "glm-5.3": ModelPreset(
        name="GLM-5.3",
        indexer_every=4,
        source="GLM-5 dimensions with one indexer per 4 MLA layers (docs/design.md, section 7; the published "
        "experiment's model)",
        **_GLM5,
    ),
    "deepseek-v3.2": ModelPreset(
        name="DeepSeek-V3.2",
        num_layers=61,
        hidden=7168,
        heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        index_heads=64,
        index_dim=128,
        indexer_every=1,
        topk=2048,
        weights_bytes=690 * GB,
        source="DeepSeek-V3.2-Exp config (61 layers, 128 heads, index 64 x 128); 685 B parameters in "
        "FP8 with MTP (about 690 GB)",
    ),
}


@dataclass(frozen=True)
class HardwarePreset:
    name: str
    hbm_bytes: int
    cpu_bytes: int  # CPU memory budget per GPU
    source: str


_CPU_SOURCE = "CPU budget: the published setting (128 GB an H200, 192 GB a B300)"
HARDWARE = {
    "h200": HardwarePreset("H200", 141 * GB, 128 * GB, f"H200: 141 GB HBM3e; {_CPU_SOURCE}"),
    "b300": HardwarePreset("B300", 288 * GB, 192 * GB, f"B300: 288 GB HBM3e; {_CPU_SOURCE}"),
}
