"""``vanilla``: dense attention through the full machinery (paged pool, slots, views).

Every other method adds policy on top of exactly this path, so ``vanilla`` equal to the unpatched
model token for token is the base of every parity test.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MethodConfig
from ..runtime.contract import SparseMethod
from .registry import register_method


@dataclass
class VanillaConfig(MethodConfig):
    """Dense attention has no options."""


@register_method
class VanillaRuntime(SparseMethod):
    name = "vanilla"
    config_class = VanillaConfig
    needs_cache_access = False
    replays_mixed_steps = True
