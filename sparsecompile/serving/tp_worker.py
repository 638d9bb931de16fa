"""The serving engine under tensor parallelism: rank 0 drives, the other ranks replay its controller calls.

Rank 0 runs the scheduler, the MemoryOracle and sampling, exactly as with one GPU. The engine reaches the
model only through its SparseController; :class:`Driver` replaces the patched model's controller by a
:class:`~sparsecompile.runtime.distributed.DistributedController` whose ``send`` broadcasts every call
(``build_pool``, ``add_sequences``, ``prefill`` with its input tokens, ``decode``, ``release_rows``, ...) to
the workers over a gloo group before running it locally. Each worker (:func:`serve_calls`) applies the same
calls to its own controller in the same order, so its allocator, page tables and method state go through the
same transitions; the forwards meet in the model's all-reduces. Workers never sample: the logits are the same
on every rank, and rank 0 sends the sampled tokens with the next step's call.

Messages are lists of calls ``(method name, args, kwargs)``: host-only calls (:data:`DEFERRED`) wait for the next
call that runs a forward and travel with it. Tensors travel as CPU tensors and land on the worker's device,
and the patched model's ``inner`` forward (the one callable argument) is replaced by the worker's own.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.hf_patch import PatchedModel
from ..runtime.distributed import DistributedController, Session, TensorParallelError

STOP = "__stop__"
#: Host-only calls (no forward, so no collective) that travel with the next message instead of one of their own:
#: the engine releases rows every step.
DEFERRED = frozenset({"release_rows", "add_sequences"})
_INNER = "__inner__"
_TENSOR = "__tensor__"


def _pack(value: Any, inner: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (_TENSOR, value.detach().cpu(), value.device.type)
    if isinstance(value, (list, tuple)):
        return type(value)(_pack(v, inner) for v in value)
    if isinstance(value, dict):
        return {k: _pack(v, inner) for k, v in value.items()}
    if callable(value):
        if value != inner:
            raise TypeError(f"cannot send the callable {value!r} to tensor-parallel workers (only the model's "
                            "inner forward is replaced on the other side)")
        return _INNER
    return value


def _unpack(value: Any, inner: Any, device: torch.device) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _TENSOR:
        return value[1].to(device if value[2] != "cpu" else "cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(v, inner, device) for v in value)
    if isinstance(value, dict):
        return {k: _unpack(v, inner, device) for k, v in value.items()}
    if isinstance(value, str) and value == _INNER:
        return inner
    return value


class Driver:
    """Rank 0's side: installs the broadcasting controller on ``patched`` (see module docstring)."""

    def __init__(self, patched: PatchedModel, session: Session) -> None:
        self.patched, self.session = patched, session
        controller = patched.controller
        local = controller.local if isinstance(controller, DistributedController) else controller
        patched.controller = DistributedController(local, session, send=self._send)
        self.closed = False
        self._pending: list[tuple] = []

    def _send(self, name: str, args: tuple, kwargs: dict) -> None:
        inner = self.patched.inner
        self._pending.append((name, _pack(args, inner), _pack(kwargs, inner)))
        if name not in DEFERRED:
            self._flush()

    def _flush(self, *extra: Any) -> None:
        import torch.distributed as dist

        calls, self._pending = [*self._pending, *extra], []
        dist.broadcast_object_list([calls], src=0, group=self.session.control)

    def close(self) -> None:
        """Tell the workers to stop (they return from :func:`serve_calls`); nothing once the group failed."""
        if self.closed:
            return
        self.closed = True
        if self.session.failed is None:
            try:
                self._flush(STOP)
            except Exception:  # a worker is already gone: its failure (if any) was reported with the step
                pass


def serve_calls(patched: PatchedModel, session: Session) -> None:
    """A worker's loop: apply rank 0's controller calls until it sends :data:`STOP` (or the group fails)."""
    import torch.distributed as dist

    controller = patched.controller
    device = controller.layout.device
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=session.control)
        except Exception as err:  # rank 0 left: its reason is on the board if it failed
            reason = session.board.peer_failure() or f"lost rank 0 ({type(err).__name__}: {err})"
            session.failed = session.failed or reason
            session.leave()
            raise TensorParallelError(f"the tensor-parallel group stopped: {reason}") from err
        for call in box[0]:
            if call == STOP:
                return
            name, args, kwargs = call
            inner = patched.inner
            getattr(controller, name)(*_unpack(args, inner, device), **_unpack(kwargs, inner, device))
