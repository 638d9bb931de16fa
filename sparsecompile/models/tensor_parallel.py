"""Tensor-parallel sharding of an HF causal LM, in place: heads, KV heads and MLP columns split across ranks.

The plan is the model's own ``base_model_tp_plan`` (the table transformers' ``tp_plan="auto"`` reads: Llama,
Qwen2/3, Mistral, Gemma3, ... declare one) or, for a model that declares none, :data:`DEFAULT_PLAN` (Llama /
Qwen / Mistral-style module names). We apply it ourselves rather than through transformers' runtime (DTensor
in 5.24, forward hooks with an in-place ``dist.all_reduce`` in 5.17): plain local tensors and functional
all-reduces trace into the compiled, CUDA-graph-replayed decode step. Styles applied:

* ``colwise`` (q/k/v, gate/up): output features split in contiguous blocks, one block per rank. q/k/v blocks
  are whole heads: rank ``r`` holds query heads ``r*Hq/n ..`` and the KV heads ``r*Hkv/n ..`` they read (GQA
  groups stay on one rank);
* ``rowwise`` (o_proj, down_proj): input features split; the partial outputs are summed with one all-reduce
  per attention block and per MLP (the bias, if any, added once after it);
* replicated entries (Qwen3's q_norm / k_norm) stay as they are. Any other style (packed or gathered
  projections such as Phi-3's ``qkv_proj``) is refused with the reason.

The embedding and the LM head are split by vocabulary rows as well (one all-reduce after the embedding, one
all-gather of the logits), so every rank holds ``1/n`` of them and ends with the same full logits; models
whose embedding or head is not a plain ``nn.Embedding`` / ``nn.Linear`` over the vocabulary keep them
replicated. KV heads must divide by the rank count (we do not replicate KV heads as vLLM does when there are
fewer KV heads than ranks). Sharding cannot be undone: ``restore()`` leaves the model sharded.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime import distributed
from ..runtime.distributed import TPGroup
from ..runtime.model_info import ModelInfo
from .support import UnsupportedModelError, attention_modules, text_config

#: The plan of a model that declares none (HF names of Llama / Qwen / Mistral-style decoders).
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_COLWISE = {"colwise", "local_colwise"}
_ROWWISE = {"rowwise", "local_rowwise"}
_REPLICATED = {"replicated_with_grad_allreduce", "replicate", "replicated", "local"}
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")
_SHARDED_ATTR = "_sparsecompile_tp"  # (size, rank) on a sharded model


@dataclass
class ShardPlan:
    """What sharding does to one model on this rank; built (and checked) by :func:`plan_tensor_parallel`."""

    group: TPGroup
    info: ModelInfo  # this rank's geometry (local head counts)
    device: torch.device
    colwise: list[nn.Linear] = field(default_factory=list)
    rowwise: list[nn.Linear] = field(default_factory=list)
    attention: list[nn.Module] = field(default_factory=list)
    shard_vocab: bool = False
    done: bool = False  # the model was sharded by an earlier optimize(): nothing to do

    def apply(self, model: nn.Module) -> None:
        """Shard the weights in place, install the collectives, move the model to this rank's device."""
        if self.done:
            return
        g = self.group
        with torch.no_grad():
            for linear in self.colwise:
                _split_rows(linear, g)
            for linear in self.rowwise:
                _split_columns(linear, g)
            for module in self.attention:
                for attr in _HEAD_ATTRS:
                    value = getattr(module, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        setattr(module, attr, value // g.size)
            if self.shard_vocab:
                _shard_vocabulary(model, g)
        model.__dict__[_SHARDED_ATTR] = (g.size, g.rank)
        model.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the full weights' blocks: give them back before the KV pool is sized


def check_head_split(model_type: str, q_heads: int, kv_heads: int, size: int) -> None:
    """Refuse ``size`` ranks that do not divide the model's query and KV heads (also before any rank starts, when
    the driver knows the model's config)."""
    if kv_heads % size or q_heads % size:
        raise UnsupportedModelError(
            f"{model_type}: {kv_heads} KV heads and {q_heads} query heads cannot be split evenly over {size} "
            f"tensor-parallel ranks; use a tp_size that divides {kv_heads} (sparsecompile does not replicate KV "
            "heads across ranks)")


def plan_tensor_parallel(model: nn.Module, info: ModelInfo, size: int, timeout: float) -> ShardPlan:
    """Join the ``size``-rank group and check that ``model`` can be split over it; changes nothing yet.

    Raises :class:`UnsupportedModelError` naming the reason (no plan, an unsupported plan style, head counts or
    widths that do not divide by ``size``, a model already sharded by transformers).
    """
    name = info.model_type
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise UnsupportedModelError(f"{name}: the model is already sharded by transformers (tp_plan=...); load it "
                                    "without tp_plan: sparsecompile.optimize(model, tp_size=N) shards it itself")
    check_head_split(name, info.num_q_heads, info.num_kv_heads, size)
    styles = _plan_of(model, name)
    group = distributed.join(size, timeout)
    local = dataclasses.replace(info, num_q_heads=info.num_q_heads // size, num_kv_heads=info.num_kv_heads // size,
                                tp=group)
    device = distributed.current().device
    sharded = model.__dict__.get(_SHARDED_ATTR)
    if sharded is not None:
        if sharded != (size, group.rank):
            raise UnsupportedModelError(f"{name}: the model was sharded for rank {sharded[1]} of {sharded[0]}; "
                                        f"this is rank {group.rank} of {size}: load it again")
        return ShardPlan(group, local, device, done=True)
    plan = ShardPlan(group, local, device)
    for module_name, module in model.named_modules():
        style = next((s for pattern, s in styles if pattern.search(module_name)), None)
        if style is None or style in _REPLICATED:
            continue
        if not isinstance(module, nn.Linear):
            raise UnsupportedModelError(f"{name}: tensor-parallel plan entry {module_name} ({style}) is a "
                                        f"{type(module).__name__}; sparsecompile shards nn.Linear layers only")
        width = module.out_features if style in _COLWISE else module.in_features
        if width % size:
            raise UnsupportedModelError(f"{name}: {module_name} has {width} features, not divisible by "
                                        f"tp_size={size}")
        (plan.colwise if style in _COLWISE else plan.rowwise).append(module)
    _check_attention(model, plan, info, size)
    plan.shard_vocab = _vocab_shardable(model)
    return plan


def _plan_of(model: nn.Module, name: str) -> list[tuple[re.Pattern, str]]:
    table = getattr(text_config(model), "base_model_tp_plan", None) or getattr(model.config, "base_model_tp_plan",
                                                                              None)
    table = dict(table or DEFAULT_PLAN)
    odd = {k: v for k, v in table.items() if v not in _COLWISE | _ROWWISE | _REPLICATED}
    if odd:
        raise UnsupportedModelError(f"{name}: tensor-parallel plan entries {odd} are not supported (sparsecompile "
                                    "shards colwise / rowwise nn.Linear layers; packed or gathered projections "
                                    "are not implemented)")
    # "layers.*.self_attn.q_proj" matches "model.layers.3.self_attn.q_proj" (a suffix, * = a layer index)
    return [(re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + "$"), v) for k, v in table.items()]


def _check_attention(model: nn.Module, plan: ShardPlan, info: ModelInfo, size: int) -> None:
    """Every attention layer must have whole heads split: colwise projections of head-aligned widths, one rowwise
    output projection."""
    col, row = {id(m) for m in plan.colwise}, {id(m) for m in plan.rowwise}
    for path, module in attention_modules(model):
        children = [c for c in module.children() if isinstance(c, nn.Linear)]
        cols = [c for c in children if id(c) in col]
        rows = [c for c in children if id(c) in row]
        if not cols or len(rows) != 1:
            raise UnsupportedModelError(
                f"{info.model_type}: no tensor-parallel plan splits the heads of {path} (the model declares no "
                "base_model_tp_plan, and its projections are not named q_proj / k_proj / v_proj / o_proj)")
        for c in cols:
            if c.out_features % (info.head_dim * size):
                raise UnsupportedModelError(f"{info.model_type}: {path} projection of {c.out_features} features "
                                            f"does not split into whole heads of {info.head_dim} over {size} ranks")
        plan.attention.append(module)


def _vocab_shardable(model: nn.Module) -> bool:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return (isinstance(emb, nn.Embedding) and emb.max_norm is None and isinstance(head, nn.Linear)
            and head.weight.shape[0] == emb.num_embeddings)


# ---------------------------------------------------------------------------------------------------- sharding
def _block(n: int, g: TPGroup) -> slice:
    per = n // g.size
    return slice(g.rank * per, (g.rank + 1) * per)


def _split_rows(linear: nn.Linear, g: TPGroup) -> None:
    rows = _block(linear.out_features, g)
    linear.weight.data = linear.weight.data[rows].clone()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[rows].clone()
    linear.out_features = linear.weight.shape[0]


def _split_columns(linear: nn.Linear, g: TPGroup) -> None:
    linear.weight.data = linear.weight.data[:, _block(linear.in_features, g)].contiguous()
    linear.in_features = linear.weight.shape[1]

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = g.all_reduce(F.linear(x, linear.weight))  # partial sums of this rank's input features
        return out if linear.bias is None else out + linear.bias

    linear.forward = forward


def _vocab_rows(weight: torch.Tensor, g: TPGroup) -> tuple[torch.Tensor, int, int]:
    """This rank's block of vocabulary rows, zero-padded to ``ceil(V / n)`` rows; returns it, its first row, its
    size."""
    vocab = weight.shape[0]
    per = -(-vocab // g.size)
    start = g.rank * per
    block = weight.new_zeros(per, *weight.shape[1:])
    rows = weight[start:min(start + per, vocab)]
    block[: rows.shape[0]] = rows
    return block, start, per


def _shard_vocabulary(model: nn.Module, g: TPGroup) -> None:
    """Split the embedding and the LM head by vocabulary rows (the same rows when their weights are tied)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    vocab = emb.num_embeddings  # stays the full vocabulary: callers check token ids against it
    tied = head.weight is emb.weight
    emb.weight.data, start, per = _vocab_rows(emb.weight.data, g)
    emb.padding_idx = None  # only shapes gradients; a global index would not fit the block
    embed = emb.forward  # the class's forward (Gemma's scaled embedding multiplies inside it)

    def embedding_forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        inside = (local >= 0) & (local < per)
        out = embed(torch.where(inside, local, torch.zeros_like(local)))
        return g.all_reduce(out.masked_fill(~inside[..., None], 0))  # one rank holds each row: an exact sum

    emb.forward = embedding_forward
    if not tied:
        head.weight.data = _vocab_rows(head.weight.data, g)[0]
    if head.bias is not None:
        head.bias.data = _vocab_rows(head.bias.data, g)[0]

    def head_forward(x: torch.Tensor) -> torch.Tensor:
        return g.all_gather(F.linear(x, head.weight, head.bias), dim=-1)[..., :vocab]

    head.forward = head_forward
