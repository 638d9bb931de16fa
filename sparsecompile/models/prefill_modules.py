"""The HF modules an eager (prefill) forward runs per token, made cheaper: MLPs over token chunks, norms and the
MLP's activation as fused kernels.

**MLP chunks** (``prefill_mlp_chunk``). A whole-prompt prefill runs each layer's MLP over every token at once: at
128K tokens the Llama-3.1-8B gate and up projections and their product are three ``[128K, 14336]`` bf16 tensors,
about 10.5 GiB of transient activations on top of the KV pool. The MLP is per token, so running it over chunks of
``tokens`` tokens of the flattened batch (written into one output buffer) gives the same result with a fraction of
the activations, while attention still sees the whole chunk.

**Fused pointwise ops** (``fuse_pointwise``). On CUDA in bf16 / fp16, a Llama-style RMSNorm runs as one
``sparsecompile::rms_norm`` kernel instead of seven, and a Llama-style MLP's ``act_fn(gate) * up`` as one
``sparsecompile::silu_mul`` (``kernels/fused_pointwise.py``: same formulas and roundings, about a tenth of the
bytes moved). A module qualifies by what it computes, not by its class name: when it is wrapped, its own forward and
the fused formula are run once on a small random input and must agree exactly (so Gemma's ``(1 + weight)`` norm or a
GELU MLP keep their forwards). fp32 keeps the model's own ops, bit for bit.

Only modules of those shapes are wrapped (an MLP with ``up_proj`` and ``down_proj``, its activation fused only with
a ``gate_proj`` and an ``act_fn``; a norm with a ``weight`` and ``variance_epsilon`` or ``eps``), called with one
hidden-states tensor. A traced call (``torch.compile`` decode steps and compiled serving forwards, which fuse these
ops themselves; ``torch.export``), another argument, or a 2-D MLP input (MoE experts get gathered tokens) runs the
original forward unchanged; an MLP input of at most ``prefill_mlp_chunk`` tokens runs in one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fused_pointwise import rms_norm, rms_norm_reference, silu_mul

_ATTR = "_sparsecompile_prefill_module"
FUSED_DTYPES = (torch.bfloat16, torch.float16)
FUSED_DEVICES = ("cuda",)  # where the fused ops run (their Triton kernels); tests add "cpu" to run the references


def _traced() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return torch.compiler.is_compiling() or bool(is_exporting and is_exporting())


def _fusable(hidden: torch.Tensor) -> bool:
    return hidden.device.type in FUSED_DEVICES and hidden.dtype in FUSED_DTYPES


# ---------------------------------------------------------------------------------------------------- MLP
def _mlp_modules(module: nn.Module) -> bool:
    return hasattr(module, "up_proj") and hasattr(module, "down_proj")


def _agrees(weight: torch.Tensor, leading: tuple[int, ...], ours: Callable, theirs: Callable) -> bool:
    """Whether ``ours(x)`` equals ``theirs(x)`` exactly on one random ``x [*leading, weight.shape[-1]]`` in the
    weight's dtype and device (a failure of either means no)."""
    if weight.device.type == "meta":
        return False
    generator = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(*leading, weight.shape[-1], generator=generator, device=weight.device).to(weight.dtype)
    try:
        with torch.no_grad():
            return torch.equal(ours(x), theirs(x))
    except Exception:  # noqa: BLE001 - any failure means "not this formula": keep the module's forward
        return False


def _silu_mlp(module: nn.Module) -> bool:
    """Whether ``module`` computes ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (checked on a random input)."""
    act = getattr(module, "act_fn", None)
    names = ("gate_proj", "up_proj", "down_proj")
    if act is None or not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return False

    def formula(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))

    weight = module.gate_proj.weight
    return _agrees(weight, (1, 3), act, F.silu) and _agrees(weight, (1, 3), module.forward, formula)


def _mlp_forward(forward: Callable, module: nn.Module, tokens: int, fused: bool) -> Callable:
    """``forward`` over runs of at most ``tokens`` rows of the flattened ``[batch * seq, hidden]`` input (0: one
    run), each run through the fused activation when ``fused`` and the input qualifies.

    Chunks are rows of the flattened tokens, not slices of the sequence axis: with a batch above 1, a slice
    ``hidden[:, a:b]`` is strided and was copied to a contiguous buffer before its projections (H200, 32K x 4,
    one profiled call each: a 132 ms elementwise kernel gone, ``aten::copy_`` 292 -> 175 ms against HF's 160), and
    a call held ``batch x tokens`` rows (peak 42.0 -> 39.2 GiB). A contiguous row range is a view and bounds a
    call's activations by ``tokens`` whatever the batch. (The prefill time did not move, 5.587 -> 5.583 s; in those
    profiles the GEMMs took 90 ms more, 2.463 -> 2.553 s; ``results/prefill_h200_rowchunks_b4*.jsonl``.)"""
    def fused_forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))

    def run(hidden, *args, **kwargs):
        if (args or kwargs or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or _traced()):
            return forward(hidden, *args, **kwargs)
        part = fused_forward if fused and _fusable(hidden) else forward
        if not tokens or hidden.shape[0] * hidden.shape[1] <= tokens:
            return part(hidden)
        rows = hidden.reshape(1, -1, hidden.shape[-1])  # a view of a contiguous input
        first = part(rows[:, :tokens])
        if not isinstance(first, torch.Tensor) or first.shape[:2] != (1, tokens):
            return forward(hidden)  # not a per-token MLP after all: the whole input, as the model asked
        out = first.new_empty((1, rows.shape[1], *first.shape[2:]))
        out[:, :tokens] = first
        del first
        for start in range(tokens, rows.shape[1], tokens):
            out[:, start:start + tokens] = part(rows[:, start:start + tokens])
        return out.view(*hidden.shape[:2], *out.shape[2:])

    return run


# ---------------------------------------------------------------------------------------------------- norms
def _norm_eps(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if not isinstance(eps, float) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    return eps


def _llama_norm(module: nn.Module, eps: float) -> bool:
    """Whether ``module`` computes :func:`rms_norm_reference` (checked on a random input, exactly)."""
    if any(True for _ in module.children()):
        return False
    return _agrees(module.weight, (2,), module.forward, lambda x: rms_norm_reference(x, module.weight, eps))


def _norm_forward(forward: Callable, module: nn.Module, eps: float) -> Callable:
    def run(hidden, *args, **kwargs):
        if args or kwargs or not isinstance(hidden, torch.Tensor) or _traced() or not _fusable(hidden):
            return forward(hidden, *args, **kwargs)
        return rms_norm(hidden, module.weight, eps)

    return run


# ---------------------------------------------------------------------------------------------------- install
def wrap_prefill_modules(model: nn.Module, mlp_chunk: int, fuse: bool) -> dict[str, int]:
    """Wrap ``model``'s Llama-style MLPs (chunked over ``mlp_chunk`` tokens when > 0; the fused activation when
    ``fuse``) and, when ``fuse``, its Llama-style RMSNorms. Returns how many of each were wrapped.

    A module whose instance already has its own ``forward`` (someone else's patch) is left alone, and whether a
    class qualifies is checked once per class (on the model's device: a probe of a tensor-parallel MLP runs its
    all-reduce, on every rank alike)."""
    verdicts: dict[tuple[type, str], bool] = {}
    counts = {"mlp": 0, "norm": 0}
    first = next(model.parameters(), None)
    fuse = fuse and first is not None and first.device.type in FUSED_DEVICES  # no probes where nothing would fuse

    def qualifies(module: nn.Module, kind: str, check: Callable[[], bool]) -> bool:
        key = (type(module), kind)
        if key not in verdicts:
            verdicts[key] = check()
        return verdicts[key]

    for module in model.modules():
        if _ATTR in module.__dict__ or "forward" in module.__dict__:
            continue
        if _mlp_modules(module):
            fused = fuse and qualifies(module, "mlp", lambda m=module: _silu_mlp(m))
            if mlp_chunk > 0 or fused:
                module.__dict__["forward"] = _mlp_forward(module.forward, module, mlp_chunk, fused)
                module.__dict__[_ATTR] = "mlp"
                counts["mlp"] += 1
        elif fuse and (eps := _norm_eps(module)) is not None \
                and qualifies(module, "norm", lambda m=module, e=eps: _llama_norm(m, e)):
            module.__dict__["forward"] = _norm_forward(module.forward, module, eps)
            module.__dict__[_ATTR] = "norm"
            counts["norm"] += 1
    return counts


def unwrap_prefill_modules(model: nn.Module) -> None:
    """Undo :func:`wrap_prefill_modules`."""
    for module in model.modules():
        if module.__dict__.pop(_ATTR, None) is not None:
            module.__dict__.pop("forward", None)
