"""ModelInfo: the facts about a model that the KV core and the methods need (no HF class involved)."""

from __future__ import annotations

from dataclasses import dataclass

from .distributed import SINGLE, TPGroup


@dataclass(frozen=True)
class ModelInfo:
    """What the engine needs to know about a causal LM (``models.support.inspect_model`` builds it).

    Attributes:
        model_type: ``config.model_type`` of the text model.
        num_layers, num_q_heads, num_kv_heads, head_dim: attention geometry (``num_q_heads % num_kv_heads == 0``);
            under tensor parallelism the heads *this rank* holds (the model's divided by ``tp.size``).
        attention_paths: qualified names of the attention modules, in layer order.
        max_position_embeddings: the model's maximum length, or None if unknown.
        tp: the ranks the heads are split over (:data:`~sparsecompile.runtime.distributed.SINGLE`: none); a method
            whose decision reduces over all heads combines its partial result with ``tp.all_reduce``.
    """

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    attention_paths: tuple[str, ...]
    max_position_embeddings: int | None
    tp: TPGroup = SINGLE
