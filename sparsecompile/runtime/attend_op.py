"""``sparsecompile::attend``: a layer's whole attention as one opaque op, served by the live SparseController.

An exported artifact's prefill program (``sparsecompile.export``) is the model's math only: each attention
layer is a call ``attend(query, key, value, layer, scale, window)`` whose body is not traced. When the loading
process runs the program, the op lands in :meth:`SparseController.attend` of the controller made current by
:func:`serving` (a process-wide registry, one controller at a time per thread), which writes the new K/V,
runs the method's hooks and the attention kernel exactly as an eager forward of the patched model does. So the
prefill keeps its host-side method work (windows, eviction plans) in Python, while the program itself needs no
HF modeling code.

``query [batch, q_heads, tokens, head_dim]``, ``key / value [batch, kv_heads, tokens, head_dim]`` ->
``[batch, tokens, q_heads, head_dim]`` contiguous (what the AttentionInterface function returns).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..kernels.library import define_op
from .compilation import before_compiling

if TYPE_CHECKING:
    from .controller import SparseController

_LOCAL = threading.local()


def current_controller() -> SparseController:
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        raise RuntimeError("sparsecompile::attend ran without a live SparseController: run exported programs "
                           "inside runtime.attend_op.serving(controller) (sparsecompile.load does)")
    return stack[-1]


@contextmanager
def serving(controller: SparseController) -> Iterator[None]:
    """Make ``controller`` the one ``sparsecompile::attend`` calls reach while the block runs."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(controller)
    try:
        yield
    finally:
        stack.pop()


def _controller_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                       window: int) -> torch.Tensor:
    return current_controller().attend(layer, query, key, value, scale, window)


_BODY = _controller_attend


def _never_traced() -> None:
    # The op's body is the controller's eager Python (host-side method work, per-step objects): a compiled forward
    # that calls the op must run it, never trace it. Once a call had traced it, every later step's new objects
    # failed the guards and recompiled it up to dynamo's limit. Set when something first compiles, since
    # torch.compiler.disable imports dynamo, which an artifact's load never needs.
    global _BODY
    _BODY = torch.compiler.disable(_controller_attend)


before_compiling(_never_traced)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
            window: int) -> torch.Tensor:
    return _BODY(query, key, value, layer, scale, window)


def _attend_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                 window: int) -> torch.Tensor:
    batch, heads, tokens, dim = query.shape
    return query.new_empty((batch, tokens, heads, dim))


attend = define_op("attend(Tensor query, Tensor key, Tensor value, SymInt layer, float scale, int window) -> Tensor",
                   cpu=_attend, cuda=_attend, fake=_attend_fake)


class OpaqueAttention:
    """Stands in for a SparseController on the attention modules while a program is traced: each layer's
    ``attend`` becomes one ``sparsecompile::attend`` call (see module docstring)."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
               sliding_window: int) -> torch.Tensor:
        return attend(query, key, value, layer, scale, sliding_window)
