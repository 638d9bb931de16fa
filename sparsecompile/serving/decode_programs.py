"""Precompiled decode programs: a new process runs ``optimize()`` + ``generate()`` without tracing the decode step.

A compiled decode step (``torch.compile``) starts warm from the on-disk inductor and AOTAutograd caches, but every
new process still has dynamo trace the step's Python: on the H200, 8.0 of the 13.7 s a warm process's first
``generate()`` pays (``benchmarks/user_path.py``; ``benchmarks/trace_count.py`` says where the instructions go).
``sparsecompile.warmup(..., programs=True)`` (``sparsecompile warmup --programs``) removes that: after compiling, it
exports the decode step at the geometry it ran (the exported artifact's decode program,
``models/export_programs.py``) and compiles it into an AOTInductor package under ``<cache root>/decode_programs``.
``optimize()`` then installs :class:`PrecompiledDecode` in front of the compiled step: a decode step whose shapes
have a package runs it, with the live model's weights as user-managed constants (no copy; fused q/k/v and
gate/up weights are views of the colocated projections), and on CUDA one graph per batch size captured at its first
step; any other step runs the compiled step as before.

A package is found by two keys. The **base key** hashes what the traced program depends on besides shapes: torch,
transformers, triton and Python versions, the GPU architecture, the model's config and dtype, the method and its
options, the engine options that shape a decode step, and sparsecompile's own source. The **shape key** hashes
the decode state's shapes (block table, slot counts, method buffers; the pool's page count is dynamic in the
program), the batch size and the method's decode variant (Quest's dense read of short batches has its own program),
so a ``generate()`` of the geometry ``warmup`` ran finds it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..config import cache_root
from ..models.colocate import SIBLINGS
from ..models.export_fusion import fuse_projections
from ..models.export_programs import WEIGHT_PREFIX, export_decode
from ..models.hf_patch import patched_model
from ..passes.fuse_linear import rows_follow
from ..runtime.controller import SparseController
from ..runtime.state_binding import decode_state
from ..runtime.step import StepState
from .aoti_package import compile_package, inductor_configs
from .artifact import AOTIProgram, ArtifactDecode
from .manifest import ArtifactError, device_facts, versions

log = logging.getLogger("sparsecompile")

#: engine options that do not change a decode step's program (compile switches, pool sizing, progress bars)
_UNTRACED = {"compile", "cuda_graphs", "compile_cache", "num_pages", "kv_cache_memory", "show_progress",
             "prefill_chunk_size", "prefill_mlp_chunk", "fuse_pointwise", "tp_timeout"}


def directory() -> Path:
    return cache_root() / "decode_programs"


@functools.cache
def source_digest() -> str:
    """sha256 over sparsecompile's own Python sources (a changed line may change a traced step)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def base_key(model: nn.Module, controller: SparseController) -> str:
    """What a decode program of ``model`` under ``controller`` depends on besides shapes (module docstring)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    engine = {k: v for k, v in asdict(controller.config).items() if k not in _UNTRACED}
    runtime = controller.runtime
    facts = {"versions": versions(), "device": device_facts(controller.layout.device), "config": config,
             "dtype": str(controller.layout.dtype), "method": type(runtime).__name__,
             "options": repr(runtime.config), "engine": engine, "source": source_digest()}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def shape_key(controller: SparseController, batch: int, variant: str) -> str:
    """The batch size, the decode variant and the static shapes of the decode state (every dim but a pool tensor's
    page count)."""
    shapes = []
    for slot in decode_state(controller):
        t = slot.get()  # None for a pool a storage format replaces (KIVI's k_pool / v_pool)
        dims = None if t is None else list(t.shape[1:] if slot.per_page else t.shape)
        shapes.append((slot.name, None if t is None else str(t.dtype), dims))
    keyed = [batch, shapes] if variant == controller.runtime.decode_variants[0] else [batch, variant, shapes]
    return hashlib.sha256(json.dumps(keyed).encode()).hexdigest()[:16]


class LiveWeights(Mapping):
    """The program constants ``lm.<HF name>`` as the live model's tensors, looked up by name (an AOTI loader asks
    for the names its package lists). A fused projection (``<module>.q_proj+k_proj+v_proj.weight``,
    ``models/export_fusion.py``) is a view over its parts when they are back to back in memory
    (``colocate_projections``), else their concatenation. ``extra``: constants the model does not hold."""

    def __init__(self, model: nn.Module, extra: dict[str, torch.Tensor] | None = None) -> None:
        self.own = {WEIGHT_PREFIX + n: t.detach() for n, t in model.named_parameters(remove_duplicate=False)}
        self.own.update({WEIGHT_PREFIX + n: t for n, t in model.named_buffers(remove_duplicate=False)})
        self.own.update(extra or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.own:
            return self.own[name]
        parts = self._parts(name)
        if parts is None:
            raise KeyError(name)
        rows = sum(p.shape[0] for p in parts)
        if parts[0].is_contiguous() and all(rows_follow(a, b) for a, b in zip(parts, parts[1:])):
            return parts[0].as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
        return torch.cat(parts)

    def _parts(self, name: str) -> list[torch.Tensor] | None:
        module, _, leaf = name.rpartition(".")  # "<owner>.<a>+<b>[+<c>]" . "weight" / "bias"
        owner, _, joined = module.rpartition(".")
        names = tuple(joined.split("+"))
        if names not in SIBLINGS or any(f"{owner}.{part}.{leaf}" not in self.own for part in names):
            return None
        return [self.own[f"{owner}.{part}.{leaf}"] for part in names]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.own or self._parts(name) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.own)

    def __len__(self) -> int:
        return len(self.own)


def build(model: nn.Module, batch: int, variant: str | None = None) -> Path:
    """Export the decode step of an optimized ``model`` at batch ``batch``, in the method's decode ``variant`` (None:
    its default) and the geometry its KV core holds now (after a ``generate()`` of that batch, before its cache is
    released), and compile its AOTI package; returns the package's path. Run by :func:`sparsecompile.warmup` with
    ``programs=True``, once per variant."""
    patched = patched_model(model)
    controller = patched.controller
    start = time.perf_counter()
    variant = controller.runtime.decode_variants[0] if variant is None else variant
    ep, state = export_decode(model, decode_state(controller), batch, batch, variant)  # checks the variant
    key = shape_key(controller, batch, variant)
    if controller.config.fuse_projections:
        ep, _ = fuse_projections(ep)
    configs = inductor_configs(controller.runtime.reads_pool_across_layers)
    package = compile_package(ep, configs, controller.layout.device)
    live = LiveWeights(model)
    named = {**ep.state_dict, **{n: v for n, v in ep.constants.items() if isinstance(v, torch.Tensor)}}
    # constants the live model cannot give back (lifted tensor constants, if a trace makes any)
    stored = {name: value.detach().cpu().contiguous() for name, value in named.items() if name not in live}
    target = directory() / base_key(model, controller)
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{key}.json").unlink(missing_ok=True)  # written last: a reader never pairs it with older files
    shutil.copyfile(package, target / f"{key}.pt2.tmp")
    os.replace(target / f"{key}.pt2.tmp", target / f"{key}.pt2")
    if stored:
        from safetensors.torch import save_file

        save_file(stored, str(target / f"{key}.constants.safetensors"))
    (target / f"{key}.json.tmp").write_text(json.dumps({"state": [slot.name for slot in state], "batch": batch,
                                                        "constants": sorted(stored)}))
    os.replace(target / f"{key}.json.tmp", target / f"{key}.json")
    log.info("precompiled the decode program for batch %d%s in %.1f s (%s)", batch,
             f" ({variant} variant)" if variant else "", time.perf_counter() - start, target / f"{key}.pt2")
    return target / f"{key}.pt2"


class PrecompiledDecode:
    """The controller's decode step (``install_decode_step``): the cached program of the step's shapes when one
    exists (module docstring), else ``fallback`` (the compiled step)."""

    def __init__(self, model: nn.Module, controller: SparseController, fallback: Callable) -> None:
        self.model = model
        self.controller = controller
        self.fallback = fallback
        self.root = directory() / base_key(model, controller)
        self.runners: dict[tuple, ArtifactDecode | None] = {}

    def __call__(self, inner, step: StepState, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        runner = self.runner(step)
        if runner is None:
            return self.fallback(inner, step, input_ids, positions)
        return runner(inner, step, input_ids, positions)

    def compiles(self, step: StepState) -> bool:
        """Whether ``step`` goes to the compiled step (no program for its shapes)."""
        return self.runner(step) is None

    def runner(self, step: StepState) -> ArtifactDecode | None:
        m = self.controller.manager
        cheap = (step.rows.shape[0], step.variant, id(m), tuple(m.block_table.shape), tuple(m.lengths.shape))
        if cheap not in self.runners:
            self.runners[cheap] = self._load(step.rows.shape[0], step.variant)
        return self.runners[cheap]

    def _load(self, batch: int, variant: str) -> ArtifactDecode | None:
        key = shape_key(self.controller, batch, variant)
        path, info = self.root / f"{key}.pt2", self.root / f"{key}.json"
        if not (path.exists() and info.exists()):
            return None
        start = time.perf_counter()
        try:
            spec = json.loads(info.read_text())
            extra: dict[str, torch.Tensor] = {}
            if spec["constants"]:
                from safetensors.torch import load_file

                device = self.controller.layout.device
                extra = {k: v.to(device)
                         for k, v in load_file(str(self.root / f"{key}.constants.safetensors")).items()}
            program = AOTIProgram(path, self.controller.layout.device, LiveWeights(self.model, extra),
                                  single_threaded=True)
        except (ArtifactError, RuntimeError, OSError, ValueError, KeyError, TypeError) as err:
            # a damaged or partial cache entry, a constant the model lacks, a package that cannot load here
            log.warning("not using the precompiled decode program %s (%s: %s): compiling the decode step instead",
                        path, type(err).__name__, err)
            return None
        runner = ArtifactDecode(program, self.controller, spec["state"], capture_live=True)
        log.info("loaded the precompiled decode program for batch %d%s in %.1f s", batch,
                 f" ({variant} variant)" if variant else "", time.perf_counter() - start)
        return runner
