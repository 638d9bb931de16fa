"""Compiling an exported program into an AOTInductor package, cached on disk by what the package depends on.

Both exported artifacts (``sparsecompile.export``) and the precompiled decode programs of ``optimize()``
(:mod:`.decode_programs`) build their packages here: the same inductor options as the compiled decode step (its
graph order), weights left out of the shared library (the loader hands them over as user-managed constants), and
the link to the process's shared libstdc++ (:mod:`.aoti_linkage`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import cache_root
from ..runtime.compilation import inductor_patches
from .aoti_linkage import check_package, link_options
from .manifest import device_facts, versions


def inductor_configs(keep_order: bool) -> dict[str, Any]:
    """Inductor options of a package: a decode step's (``keep_order``: the method reads the pool across layers),
    weights outside the shared library, the shared-libstdc++ link."""
    configs = inductor_patches(cuda_graphs=False, keep_order=keep_order)
    configs["aot_inductor.package_constants_in_so"] = False  # weights: handed over at load
    configs.update(link_options())  # one libstdc++ in the loading process (see aoti_linkage)
    return configs


def package_key(ep: torch.export.ExportedProgram, configs: dict[str, Any], device: torch.device) -> str:
    """What an AOTI package depends on besides the weights' values (which it does not contain)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"versions": versions(), "device": device_facts(device), "configs": configs},
                             sort_keys=True, default=str).encode())
    digest.update(ep.graph_module.code.encode())
    digest.update(str(ep.graph_signature).encode() + str(ep.range_constraints).encode())
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            digest.update(f"{node.name}:{getattr(val, 'shape', val)}:{getattr(val, 'dtype', '')}".encode())
            if isinstance(val, torch.Tensor):
                digest.update(str(val.stride()).encode())
    for name, value in sorted(ep.constants.items()):
        if isinstance(value, torch.Tensor):
            digest.update(name.encode() + value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def compile_package(ep: torch.export.ExportedProgram, configs: dict[str, Any], device: torch.device) -> Path:
    """The AOTI package of ``ep`` under ``<cache root>/aoti``, compiled unless an identical one exists (the prefill
    program is the same for every method of a model). A package that would not load in this process (its own
    static libstdc++) fails here, with the reason, rather than in the serving process."""
    import torch._inductor.config as inductor_config

    cached = cache_root() / "aoti" / f"{package_key(ep, configs, device)}.pt2"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        # AOTI writes the package's device facts into ``aot_inductor.metadata`` in place; on the process-wide dict
        # they would then join every later graph's inductor cache key in this process, so a later load of an
        # exported artifact missed its shipped compile cache. The compile gets its own copy.
        metadata = configs.get("aot_inductor.metadata", inductor_config.aot_inductor.metadata)
        isolated = {**configs, "aot_inductor.metadata": dict(metadata)}
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            built = torch._inductor.aoti_compile_and_package(ep, package_path=str(Path(tmp) / "package.pt2"),
                                                             inductor_configs=isolated)
            check_package(Path(built))
            os.replace(built, cached)
    return cached
