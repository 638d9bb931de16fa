"""The ``sparsecompile`` torch.library namespace and the helper every op file uses to register itself.

Ops are defined with ``torch.library.Library`` (about 10 us per eager call, against about 40 us for
``torch.library.custom_op``). Each op has a torch reference registered for CPU, a Triton launch for
CUDA, and a fake (meta) implementation whose output strides match the real ones. Mutated arguments
are declared in the schema (``Tensor(a!)``) so that inductor neither drops nor clones them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "sparsecompile"
LIB = torch.library.Library(NAMESPACE, "DEF")


def define_op(schema: str, *, cpu: Callable, cuda: Callable | None, fake: Callable) -> Callable:
    """Define ``sparsecompile::<name>`` from ``schema`` and register its CPU, CUDA and fake kernels.

    Returns the ``torch.ops.sparsecompile.<name>.default`` overload.
    """
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, cpu, "CPU")
    LIB.impl(name, cuda if cuda is not None else cpu, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
