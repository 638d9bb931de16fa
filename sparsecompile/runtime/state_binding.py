"""The device state a decode step reads and mutates, as a flat list of named tensors (for exported programs).

A compiled decode step (``SparseController.enable_compiled_decode``) reaches the KV pool, the block table, the
slot counts and the method's buffers as attributes of the CacheManager and the method runtime; dynamo lifts
them into graph inputs by itself. ``torch.export`` needs them as explicit inputs instead: :func:`decode_state`
lists every such tensor as a :class:`StateSlot` (owner + attribute or dict key), and :func:`bound` points the
owners at other tensors (the traced inputs while exporting) for the duration of a block, then restores them.
A loading process builds the same KV core from the same options, so the same slots name the live tensors it
passes to the exported program at every step.

What is collected: the manager's ``k_pool, v_pool, pos_pool, block_table, lengths``, every registered slot /
page metadata tensor, and the method runtime's tensor attributes, directly or one object down (e.g. a
``ReadCounter``'s buffer). Dicts and lists of tensors in a runtime hold per-row prefill state (SnapKV's
windows), which a decode step does not read, and are left out. Exporters check that the traced program lifted
no other tensor as a constant, so a state tensor this list missed fails the export instead of freezing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .controller import SparseController

_MANAGER_TENSORS = ("k_pool", "v_pool", "pos_pool", "block_table", "lengths")
#: tensors whose first dimension is the pool's page count (+1 trash page): dynamic in exported programs
POOL_PREFIXES = ("manager.k_pool", "manager.v_pool", "manager.pos_pool", "slot_metadata.", "page_metadata.")


@dataclass(frozen=True)
class StateSlot:
    """One state tensor: ``owner.<key>`` (an attribute) or ``owner[key]`` (a dict entry)."""

    name: str
    owner: Any
    key: str
    item: bool = False

    def get(self) -> torch.Tensor:
        return self.owner[self.key] if self.item else getattr(self.owner, self.key)

    def set(self, value: Any) -> None:
        if self.item:
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)

    @property
    def per_page(self) -> bool:
        """Its first dimension counts pool pages (sized by the loading process's memory budget)."""
        return self.name.startswith(POOL_PREFIXES)


def _tensor_attributes(obj: Any) -> list[tuple[str, Any, str]]:
    """``(path, owner, attribute)`` of the tensors held by ``obj`` and by plain objects it holds (one level)."""
    found = []
    for attr, value in sorted(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            found.append((attr, obj, attr))
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
            found += [(f"{attr}.{sub}", value, sub) for sub, inner in sorted(vars(value).items())
                      if isinstance(inner, torch.Tensor)]
    return found


def decode_state(controller: SparseController) -> list[StateSlot]:
    """Every device tensor a decode step of ``controller`` may read or write, in a stable order.

    Call it after the pool exists and one decode step ran (methods create some buffers lazily, in
    ``prepare_step``).
    """
    m = controller.manager
    if m is None:
        raise RuntimeError("decode_state needs a KV pool: build it first (SparseController.build_pool)")
    slots = [StateSlot(f"manager.{name}", m, name) for name in _MANAGER_TENSORS]
    slots += [StateSlot(f"slot_metadata.{name}", m.slot_metadata, name, item=True) for name in sorted(m.slot_metadata)]
    slots += [StateSlot(f"page_metadata.{name}", m.page_metadata, name, item=True) for name in sorted(m.page_metadata)]
    slots += [StateSlot(f"method.{path}", owner, attr) for path, owner, attr in _tensor_attributes(controller.runtime)]
    return slots


def state_tensors(slots: Sequence[StateSlot]) -> list[torch.Tensor]:
    return [slot.get() for slot in slots]


@contextmanager
def bound(slots: Sequence[StateSlot], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Point every slot at the matching tensor of ``tensors`` while the block runs (restored afterwards).

    The manager's trash page (the pool's last page, which absorbs masked writes) is read from the bound pool's
    shape (``CacheManager.trash_page``), so a program traced with a symbolic page count keeps it symbolic instead of
    baking the example pool's size.
    """
    if len(slots) != len(tensors):
        raise ValueError(f"{len(slots)} state slots but {len(tensors)} tensors")
    saved = [slot.get() for slot in slots]
    try:
        for slot, tensor in zip(slots, tensors):
            slot.set(tensor)
        yield
    finally:
        for slot, tensor in zip(slots, saved):
            slot.set(tensor)
