"""ModelInfo: the facts about a model that the KV core and the methods need (no HF class involved)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a causal LM (``models.support.inspect_model`` builds it).

    Attributes:
        model_type: ``config.model_type`` of the text model.
        num_layers, num_q_heads, num_kv_heads, head_dim: attention geometry (``num_q_heads % num_kv_heads == 0``).
        attention_paths: qualified names of the attention modules, in layer order.
        max_position_embeddings: the model's maximum length, or None if unknown.
    """

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    attention_paths: tuple[str, ...]
    max_position_embeddings: int | None
