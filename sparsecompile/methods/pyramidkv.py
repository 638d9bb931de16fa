"""``pyramidkv``: SnapKV selection with a pyramid of per-layer budgets (Cai et al., https://arxiv.org/abs/2406.02069).

Scoring, pooling, GQA handling and the window are SnapKV's (see ``snapkv.py``). Layer budgets follow
kvpress' ``PyramidKVPress`` (the variant that forces the mean over layers to the requested budget;
KVCache-Factory's integer formula only approximates it): with ``B`` the budget (window included)
and ``n`` the prompt length,

    lo = B / beta,  hi = 2B - lo;   if hi >= n - window: hi = n - window, lo = 2B - hi
    budget(layer) = hi - layer * (hi - lo) / (L - 1)        (layer 0 keeps the most)

and when ``not n >= hi >= lo >= window`` (e.g. ``B < beta * window``, or a prompt no longer than
``B``) every layer gets ``B``, as kvpress falls back to SnapKV. Rounding: kvpress rounds each layer
on its own, so the mean drifts by up to half a token; we round with the largest-remainder method
(ties to the lower layer), so the budgets sum to exactly ``L * B``. With ``ratio``, ``B = int(n * ratio)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import MethodConfigError, option
from .registry import register_method
from .snapkv import SnapKVConfig, SnapKVRuntime


@dataclass
class PyramidKVConfig(SnapKVConfig):
    """Options of ``pyramidkv``: SnapKV's plus ``beta`` (steepness: the last layer keeps ``budget / beta``)."""

    beta: float = option(20.0, "pyramid steepness: the last layer keeps about budget / beta")

    method = "pyramidkv"

    def validate(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise MethodConfigError(f"pyramidkv: beta must be >= 1, got {self.beta!r}")
        super().validate()


def pyramid_budgets(budget: int, prompt_len: int, window: int, beta: float, num_layers: int) -> list[int]:
    """Per-layer budgets (window included) whose sum is ``num_layers * budget`` (see module docstring)."""
    lo = budget / beta
    hi = 2 * budget - lo
    if hi >= prompt_len - window:
        hi = prompt_len - window
        lo = 2 * budget - hi
    if num_layers == 1 or not prompt_len >= hi >= lo >= window:
        return [budget] * num_layers
    step = (hi - lo) / (num_layers - 1)
    exact = [hi - layer * step for layer in range(num_layers)]
    out = [math.floor(x) for x in exact]
    extra = min(num_layers, max(0, num_layers * budget - sum(out)))
    for layer in sorted(range(num_layers), key=lambda i: (out[i] - exact[i], i))[:extra]:
        out[layer] += 1
    return out


@register_method
class PyramidKVRuntime(SnapKVRuntime):
    name = "pyramidkv"
    config_class = PyramidKVConfig
    config: PyramidKVConfig

    def layer_budgets(self, prompt_len: int) -> list[int]:
        c = self.config
        return pyramid_budgets(c.budget_for(prompt_len), prompt_len, c.window, c.beta, self.model.num_layers)
