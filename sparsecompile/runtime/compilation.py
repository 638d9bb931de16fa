"""Compile settings, in one place: when decode steps compile, with which dynamo / inductor options, and how
CUDA graphs are chosen.

Everything that calls ``torch.compile`` or sets dynamo / inductor configuration goes through here (the decode
step in the controller, the capture backend in ``passes/``, the SDPA-rewrite fallback, the serving engine's
CUDA-graph batch sizes), so a new knob or a version workaround has one home.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..config import cache_root

logger = logging.getLogger("sparsecompile")
if not logger.handlers:  # a library default, as transformers does: INFO to stderr, silence with setLevel(WARNING)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("sparsecompile: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def wanted(flag: bool | str, device: torch.device) -> bool:
    """An ``EngineConfig.compile`` / ``cuda_graphs`` value resolved for ``device`` ("auto" = on CUDA)."""
    return torch.device(device).type == "cuda" if flag == "auto" else bool(flag)


def decode_compiled(compile_flag: bool | str, device: torch.device) -> bool:
    return wanted(compile_flag, device)


def decode_cuda_graphs(compile_flag: bool | str, graphs_flag: bool | str, device: torch.device) -> bool:
    """CUDA graphs need a compiled step on a CUDA device."""
    return decode_compiled(compile_flag, device) and wanted(graphs_flag, device) and torch.device(device).type == "cuda"


def inductor_patches(*, cuda_graphs: bool, keep_order: bool) -> dict[str, Any]:
    """Inductor options of a compiled decode step.

    ``triton.cudagraphs``: what ``mode="reduce-overhead"`` does, with our own backend in front. ``keep_order`` turns
    off ``reorder_for_locality``, which sinks nodes to just before their first user: it moved OmniKV's scoring of
    the filter layer's keys past the next layer's kv_write, so that write could no longer happen in place and the
    key pool was copied whole (32 GiB at 128K x 4) for the score to read the old version.

    ``max_fusion_buffer_group_pairwise_attempts`` 16 (inductor's default 64): the fusion search tries every pair of
    nodes within that many of each other among the nodes that touch one buffer, and a decode step's pools, tables
    and lengths are touched by every layer. Compiling H2O's 32-layer step on CPU (tiny Llama, cold caches) checked
    58,675 pairs in 18.1 of its 156 s (profiled); at 16 the scheduler took 5.4 s instead of 9.3 (4 gave 3.5), and
    the generated kernels were the same 466: the fusions a step gets are between neighbours.
    """
    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {"triton.cudagraphs": cuda_graphs}
    if hasattr(inductor_config, "max_fusion_buffer_group_pairwise_attempts"):  # (a version without it: the default)
        patches["max_fusion_buffer_group_pairwise_attempts"] = 16
    if keep_order:
        patches["reorder_for_locality"] = False
    return patches


def compile_step(fn: Callable, backend: Callable) -> Callable:
    """Compile a decode step: one graph (``fullgraph``), static shapes (one graph per batch size).

    ``fn`` (a function or bound method) is compiled through a private copy of its code object: dynamo keeps
    compiled variants, and counts them against ``recompile_limit``, per code object, so every engine built in one
    process (a server swapping models, a benchmark with one ``LLM`` per method, a test session) would otherwise
    pile its graphs onto the one ``_decode_eager`` and the next engine's first compile would fail the limit.
    """
    apply_deferred_marks()
    return torch.compile(_private_code(fn), backend=backend, fullgraph=True, dynamic=False,
                         options={"guard_filter_fn": decode_guard_filter})


def decode_guard_filter(entries: list) -> list[bool]:
    """Dynamo guards a decode step keeps: all but the tensor-metadata guards of the model's own parameters and
    buffers (``TENSOR_MATCH`` on a source inside an ``nn.Module``: dtype, device, shape, strides).

    Those are most of the step's guard time (about 300 tensors in a 32-layer model): guard evaluation of one decode
    call of a 32-layer tiny Llama on the 2-core CI machine takes 267-272 us with them and 117-123 us without
    (vanilla, snapkv, h2o; best of 15 interleaved rounds), host time that every token pays. The step's own
    inputs (step tensors, pools, token ids) keep theirs, and so do module identities and types, instance dicts and
    attribute values, so a swapped module or a changed flag still recompiles (hooks added after compiling are not
    guarded in any case: dynamo's ``skip_nnmodule_hook_guards``). What the dropped guards caught, a model cast or
    moved after ``optimize`` (``model.half()``, ``model.to(device)``), is refused by the controller instead
    (:meth:`~.controller.SparseController.watch_parameters`): the KV pool was sized for the old dtype anyway.
    """
    return [_keep_guard(entry) for entry in entries]


def _keep_guard(entry) -> bool:
    source = getattr(getattr(entry, "orig_guard", None), "source", None)  # (kept when a torch version lacks them)
    in_model = source is not None and source.is_unspecialized_nn_module()
    return not (in_model and getattr(entry, "guard_type", None) == "TENSOR_MATCH")


def _private_code(fn: Callable) -> Callable:
    """``fn`` with a copy of its code object (equal, not identical: dynamo's cache for it starts empty)."""
    target = getattr(fn, "__func__", fn)
    copy = types.FunctionType(target.__code__.replace(), target.__globals__, target.__name__, target.__defaults__,
                              target.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = target.__kwdefaults__, target.__qualname__
    bound = getattr(fn, "__self__", None)
    return types.MethodType(copy, bound) if bound is not None else copy


def page_indexed(t: torch.Tensor) -> torch.Tensor:
    """Marks a tensor indexed by page (dim 0 = the pool's page count) for compiled decode steps; returns it.

    A static address: the step mutates it in place and CUDA graphs keep its address. And dim 0 dynamic: a pool that
    grows (a longer prompt than any before, in ``capacity_bucket`` steps of at most 3 %) gets new tensors of a new
    size, and with that size specialized each growth recompiled the decode step (26-46 s on the 8B shape on the
    H200, inside the timed 128K + 256-token ``generate()`` of ``benchmarks/prefill.py --e2e`` after a 4K warm-up).
    ``maybe_``: a graph that does need a concrete size specializes instead of failing to compile."""
    return mark_for_compile(t, dynamic_dims=(0,))


def static_address(t: torch.Tensor) -> torch.Tensor:
    """Marks a persistent buffer that compiled steps read and mutate in place (its address is part of a CUDA
    graph, so dynamo need not guard on it); returns it."""
    return mark_for_compile(t)


_DEFERRED: list[tuple[weakref.ref, tuple[int, ...]]] = []


def mark_for_compile(t: torch.Tensor, dynamic_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """``torch._dynamo.mark_static_address(t)`` and ``maybe_mark_dynamic(t, d)`` for each of ``dynamic_dims``.

    Deferred while nothing has imported ``torch._dynamo`` (1-3 s of import, which an exported artifact's load, whose
    programs are already compiled, never needs): the compile entry points here apply the deferred marks first
    (:func:`apply_deferred_marks`)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        if len(_DEFERRED) > 1024:  # tensors freed meanwhile (pool growth, resized buffers)
            _DEFERRED[:] = [entry for entry in _DEFERRED if entry[0]() is not None]
        _DEFERRED.append((weakref.ref(t), tuple(dynamic_dims)))
    else:
        _mark(dynamo, t, dynamic_dims)
    return t


def _mark(dynamo, t: torch.Tensor, dynamic_dims: tuple[int, ...]) -> None:
    dynamo.mark_static_address(t)
    for dim in dynamic_dims:
        dynamo.maybe_mark_dynamic(t, dim)


_DEFERRED_HOOKS: list[Callable[[], None]] = []


def before_compiling(hook: Callable[[], None]) -> None:
    """Run ``hook`` now if ``torch._dynamo`` is imported, else the first time a path here compiles (the same
    deferral as :func:`mark_for_compile`: a module that needs a dynamo setting need not import dynamo)."""
    if "torch._dynamo" in sys.modules:
        hook()
    else:
        _DEFERRED_HOOKS.append(hook)


def apply_deferred_marks() -> None:
    """Apply the marks :func:`mark_for_compile` deferred and run the hooks :func:`before_compiling` deferred (every
    path to ``torch.compile`` calls this first)."""
    import torch._dynamo as dynamo

    while _DEFERRED_HOOKS:
        _DEFERRED_HOOKS.pop(0)()
    while _DEFERRED:
        ref, dims = _DEFERRED.pop()
        tensor = ref()
        if tensor is not None:
            _mark(dynamo, tensor, dims)


def compile_forward(fn: Callable, backend: str | Callable = "inductor", layer_index_dynamic: bool = False) -> Callable:
    """Compile a prefill / mixed-step forward (``models/compiled_forward.py``): ``backend`` (inductor; tests may
    pass ``aot_eager``), dynamic shapes (one graph for every token count), the decode step's guard filter, through a
    private code object (see :func:`compile_step`). A few variants exist (dynamo specializes sizes of 1: batch 1 or
    more): :func:`allow_recompiles` covers them.

    ``layer_index_dynamic``: ``fn`` is a decoder layer's ``forward`` compiled once for every layer (regional
    compilation): int attributes of the modules it reads become symbolic inputs instead of constants, so the
    layer index that each attention call passes on does not give every layer a graph of its own."""
    import torch._dynamo.config as dynamo_config

    allow_recompiles(16)
    apply_deferred_marks()
    compiled = torch.compile(_private_code(fn), backend=backend, dynamic=True,
                             options={"guard_filter_fn": decode_guard_filter})
    # Floats stay constants (dynamo makes them symbols under dynamic=True): the model's float attributes (every
    # norm's eps, every attention layer's scale) then added a symbol each, and turning them back into tensors
    # restarted the trace, a second full trace of the model per variant.
    return dynamo_config.patch(specialize_float=True, allow_unspec_int_on_nn_module=layer_index_dynamic)(compiled)


def compile_dynamic(fn: Callable, backend: Callable) -> Callable:
    """Compile a whole-model forward with dynamic shapes (the SDPA-rewrite fallback)."""
    apply_deferred_marks()
    return torch.compile(fn, backend=backend, dynamic=True)


def allow_recompiles(graphs: int) -> None:
    """Let dynamo keep ``graphs`` compiled variants of one function (one per CUDA-graph batch size)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs)


def enable_compile_caches() -> str:
    """Keep compiled graphs on disk so a new process starts warm: inductor's FX graph cache and the AOTAutograd
    cache, with inductor's and Triton's cache directories under ``<cache_root>/compile/torch-<version>`` (a user's
    own ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` win). Returns the inductor cache directory.

    Importing ``torch._inductor.config`` sets ``TORCHINDUCTOR_CACHE_DIR`` to torch's default
    (``/tmp/torchinductor_<user>``) as a side effect, so that value counts as unset: the graphs then land in our
    cache directory, which benchmarks and deployments carry between machines, not in ``/tmp``."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = cache_root() / "compile" / f"torch-{torch.__version__}"
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(base / "triton"))
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@contextmanager
def compile_notice(what: str, compiles: bool = True) -> Iterator[None]:
    """Tell the user a graph is being compiled (the first call of each shape; later processes hit the disk cache).
    Silent when ``compiles`` is False (the step loads a precompiled program, which says so itself)."""
    if not compiles:
        yield
        return
    logger.info("compiling %s (first call; cached on disk for later processes) ...", what)
    start = time.perf_counter()
    yield
    logger.info("compiled %s in %.1f s", what, time.perf_counter() - start)
