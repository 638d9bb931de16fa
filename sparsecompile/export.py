"""``sparsecompile.export`` / ``sparsecompile.load``: compiled artifacts that serve without tracing or compiling.

What is exported, and why this shape
------------------------------------
The serving engine's step is split in two by nature: host work (page allocation and table flushes, the
method's ``prepare_step`` / ``commit_step``, eviction planning, scheduling) and device work (the model
forward with each layer's KV write, selection and attention, then the method's ``finish_step``). The host
work is Python in the KV core (``runtime/``, ``methods/``) and has no HF code in it, so an artifact keeps it as
is: the loader rebuilds the same SparseController from the manifest. What is exported is the device work:

* **decode** (the hot path): one step with attention *traced in* (``models/export_programs.py``): the pool,
  block table, slot counts and method buffers are explicit mutated inputs, the batch and the pool's page count
  are dynamic. It is the very graph the compiled path runs (same ops, same inductor lowering), so decode speed
  follows it, and a decode step has no host sync, so the loader captures one CUDA graph per batch bucket over
  it. Exporting the forward with an opaque attention op instead would have served decode as well, but each
  layer's write / view / attention would then run as eager launches inside the graph (some twenty small
  kernels per layer instead of a few fused ones): several percent of a batch-1 decode step.
* **prefill**: the model math with each layer's attention as one opaque ``sparsecompile::attend`` op that calls
  the loading process's controller (``runtime/attend_op.py``); batch, tokens and kept positions are dynamic.
  Prefill hooks are host-heavy (SnapKV's windows, eviction plans, H2O's chunk-wise eviction read host counts),
  and a chunk's cost is its GEMMs, so keeping the per-layer lifecycle eager costs nothing measurable, and one
  program serves every chunk shape of every method (it is method-independent, and cached across exports).

Both programs take the weights as AOTInductor user-managed constants, stored once in ``weights.safetensors``;
with ``fuse_projections`` (the default) each layer's q/k/v and gate/up weights are one fused weight and one GEMM
(``models/export_fusion.py``), as in the compiled decode step.
On CUDA, inductor's own kernels are cubins inside the packages; sparsecompile's ops (defined with
``torch.library``, not ``triton_op``) are called back through AOTI's proxy executor, so the loader imports
``sparsecompile.kernels`` (never the HF modeling code), and CUDA graphs remove that host cost from decode.

The artifact directory: ``manifest.json`` (``serving/manifest.py``), ``prefill.pt2`` and ``decode.pt2`` (form
``aoti``; form ``exported`` ships ``*.ep.pt2`` torch.export programs instead), ``weights.safetensors``,
``tokenizer/`` and ``config.json``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import OPTION_KINDS, EngineConfig, ServingConfig
from .serving.aoti_package import compile_package, inductor_configs
from .serving.artifact import PhaseTimer
from .serving.manifest import FORMS, ArtifactError, device_facts, hash_files, read, write

log = logging.getLogger(__name__)

#: pages of the pool the programs are traced with (the page count is dynamic: any pool size loads)
EXAMPLE_PAGES = 97


def export(model: nn.Module | str | os.PathLike | None, out_dir: str | os.PathLike, method: str = "vanilla", *,
           tokenizer=None, device: str | None = None, dtype: torch.dtype | None = None, form: str = "aoti",
           compile_cache: bool = True, kernels: bool = True, **options: Any) -> Path:
    """Export ``model`` with ``method`` into the artifact directory ``out_dir``; returns its path.

    Args:
        model: an HF causal LM (pass ``tokenizer`` too), an HF directory, a ``.gguf`` file, or None for the
            embedded SmolLM2-135M-Instruct. An nn.Module is patched in place (``optimize``).
        method, options: as for :class:`sparsecompile.LLM`: method options, engine options and serving options.
            ``max_num_seqs`` and ``max_model_len`` are fixed in the artifact (the decode program's tables have
            their shapes); the KV memory is chosen at load.
        form: ``"aoti"`` (AOTInductor packages, the default) or ``"exported"`` (torch.export programs: the fallback
            for hosts where AOTI packages do not load). On the H200 image (torch 2.11 + CUDA 13.0) every CUDA
            package crashed its process at load until packages linked the shared libstdc++ (the image's compiler
            links it statically: ``serving/aoti_linkage.py``); they load there now, and a package that does not
            link it is refused at export and at load.
        compile_cache: with ``form="exported"``, compile the decode program at every batch bucket in a fresh
            child process that loads the artifact, and ship its ``torch.compiler`` cache artifacts, so a loading
            process compiles it warm (False: it runs eagerly; when the child fails, a warning says why and loading
            processes compile it themselves).
        kernels: on CUDA, trial-load the artifact in a child process and ship the Triton kernels of sparsecompile's
            own ops it compiled (``kernels/``, ``serving/artifact_kernels.py``), so a load on a machine whose Triton
            cache lacks them does not compile them; the trial load also proves the artifact loads (when it fails,
            a warning says why and the artifact ships no kernels).
    """
    from .models.default_model import load_model, resolve_model_path
    from .optimize import optimize, restore, split_method_options

    routed = split_method_options(method, options, accepted=OPTION_KINDS)
    serving = ServingConfig(**routed["serving"])
    engine_options = asdict(EngineConfig(**routed["engine"]))
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ValueError("pass tokenizer= together with a model object")
        name = serving.model_name or getattr(model.config, "_name_or_path", None) or None
    else:
        given = model
        model, loaded = load_model(given, dtype=dtype, device=device)
        tokenizer = tokenizer or loaded
        name = serving.model_name or (str(given) if given is not None else resolve_model_path(None).name)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    timer = PhaseTimer()
    optimize(model, method, **{**engine_options, "compile": False, "cuda_graphs": False, "num_pages": EXAMPLE_PAGES},
             **routed["method"])
    try:
        out = _export_patched(model, tokenizer, method, routed, serving, engine_options, name, Path(out_dir), form,
                              compile_cache, timer)
    finally:
        restore(model)  # the programs hold what they need; give the model back as it came
    if form == "exported" and compile_cache:
        _ship_compile_cache(out, timer)
    if kernels and read(out)["device"]["type"] == "cuda":
        _ship_kernels(out, timer)
    return out


def _export_patched(model: nn.Module, tokenizer, method: str, routed: dict[str, dict[str, Any]], serving: ServingConfig,
                    engine_options: dict[str, Any], name: str | None, out: Path, form: str,
                    compile_cache: bool, timer: PhaseTimer) -> Path:
    """Trace, compile and write the artifact of a model patched for export (see :func:`export`); the manifest's
    ``export_seconds`` says where the time went (patch, trace, fuse, one entry per program, weights, ...)."""
    from .models.export_fusion import fuse_projections
    from .models.export_programs import export_decode, export_prefill
    from .models.hf_patch import patched_model
    from .runtime.state_binding import decode_state
    from .serving.engine import LLMEngine

    patched = patched_model(model)
    controller = patched.controller
    timer.device = controller.layout.device
    engine = LLMEngine(model, tokenizer, replace(serving, kv_cache_memory=None, gpu_memory_utilization=None))
    max_batch = engine.config.max_num_seqs
    example_batch = min(3, max_batch)
    empty = torch.zeros(0, 1, dtype=torch.long, device=controller.layout.device)
    controller.decode(patched.inner, [], empty, empty, pad_to=example_batch)  # creates the methods' lazy buffers
    timer.done("patch")
    decode, state = export_decode(model, decode_state(controller), example_batch, max_batch)
    timer.done("trace_decode")
    programs = {"prefill": export_prefill(model, engine.max_model_len, max_batch), "decode": decode}
    timer.done("trace_prefill")
    fused: dict[str, int] = {}
    if engine_options["fuse_projections"]:  # as the compiled decode step does: one GEMM per q/k/v and gate/up
        shared: dict[str, torch.Tensor] = {}
        for key in programs:
            programs[key], fused[key] = fuse_projections(programs[key], shared)
        timer.done("fuse")

    out.mkdir(parents=True, exist_ok=True)
    device_ = controller.layout.device
    files: list[str] = []
    specs: dict[str, dict[str, Any]] = {
        "prefill": {"inputs": ["input_ids", "position_ids", "keep"], "tokens": [1, engine.max_model_len],
                    "batch": [1, max_batch]},
        "decode": {"inputs": ["input_ids", "positions", "rows", "new_offsets", "num_new"],
                   "state": [slot.name for slot in state], "batch": [1, max_batch]},
    }
    configs = inductor_configs(controller.runtime.reads_pool_across_layers)
    for key, ep in programs.items():
        if form == "aoti":
            file = f"{key}.pt2"
            shutil.copyfile(compile_package(ep, configs, device_), out / file)
        else:
            file = f"{key}.ep.pt2"
            _save_program(ep, out / file)
        specs[key]["file"] = file
        specs[key]["fused_groups"] = fused.get(key, 0)
        files.append(file)
        timer.done(f"{'compile' if form == 'aoti' else 'save'}_{key}")
    weights = _save_weights(programs.values(), out / "weights.safetensors")
    timer.done("weights")
    if form == "exported" and compile_cache:  # the loader compiles the decode program with these options
        specs["decode"]["inductor"] = {k: v for k, v in configs.items() if k != "aot_inductor.package_constants_in_so"}
    tokenizer.save_pretrained(str(out / "tokenizer"))
    files += [str(p.relative_to(out)) for p in sorted((out / "tokenizer").rglob("*")) if p.is_file()]
    model.config.to_json_file(str(out / "config.json"))
    files.append("config.json")

    info = controller.runtime.model
    serving_out = asdict(engine.config)
    serving_out.update(max_model_len=engine.max_model_len, model_name=name)
    manifest = {
        "form": form,
        "device": device_facts(device_),
        "model": {"info": {**asdict(info), "attention_paths": list(info.attention_paths)},
                  "dtype": str(controller.layout.dtype).removeprefix("torch."), "vocab_size": engine.patched.vocab_size,
                  "max_length": patched.max_length, "eos_token_ids": sorted(engine.eos_token_ids), "name": name},
        "method": {"name": method, "options": routed["method"]},
        "engine": {**engine_options, "num_pages": routed["engine"].get("num_pages")},
        "serving": serving_out,
        "programs": specs,
        "weights": weights,
        "buckets": engine.graph_sizes,
        "tokenizer": "tokenizer",
        "tokenizer_class": f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}",
        "files": hash_files(out, files),
    }
    timer.done("hash")
    manifest["export_seconds"] = timer.seconds  # informational: not part of the fingerprint
    write(out, manifest)
    return out


def load(path: str | os.PathLike, *, device: str | None = None, verify: bool = True, **options: Any):
    """An :class:`sparsecompile.LLM` (``generate``, ``chat``) serving the artifact in ``path``.

    Runs the artifact's compiled programs: nothing is traced or compiled, no HF modeling code is imported. Refuses
    (``ArtifactError``, with the reason) an artifact built by another torch or for another GPU architecture, or
    one whose files changed since export. ``options``: load-time serving options (``kv_cache_memory``,
    ``gpu_memory_utilization``, ``num_pages``, ``max_num_batched_tokens``, ``cuda_graph_sizes``, ``model_name``).
    """
    from .llm import LLM
    from .serving.artifact import load_engine

    return LLM.from_engine(load_engine(path, device=device, verify=verify, **options))


# ---------------------------------------------------------------------------------------------------- helpers
def _ship_compile_cache(out: Path, timer: PhaseTimer) -> None:
    """The fallback form's warm start: the decode program's compile cache, made by a fresh process that loads the
    written artifact and compiles every batch bucket (``serving/artifact_kernels.py`` says why not this process);
    the file is hashed into the manifest. Loading the artifact also covers the weights as the loader reads them
    (on CUDA inductor keys a graph on its parameters' storage offsets and sizes). When that process fails, the
    artifact still serves (compiling at load) and a warning says why it is not warm, as for shipped kernels."""
    from .serving.artifact_kernels import compile_decode_cache

    file = "decode.cache.bin"
    try:
        compile_decode_cache(out, file)
    except (ArtifactError, subprocess.TimeoutExpired) as err:  # e.g. a second copy of the weights does not fit
        log.warning("the artifact in %s ships no compile cache (a loading process compiles the decode program "
                    "itself): %s", out, err)
        return
    timer.done("compile_cache")
    _add_files(out, timer, [file], lambda manifest: manifest["programs"]["decode"].update(compile_cache=file))


def _ship_kernels(out: Path, timer: PhaseTimer) -> None:
    """Add the trial load's Triton kernels to the written artifact (files hashed, manifest rewritten). A trial load
    that fails (a second copy of the weights may not fit beside the exporting process's model) leaves the artifact
    without kernels, with a warning that says why: a loading process then compiles them on first use."""
    from .serving.artifact_kernels import KERNELS, compile_kernels

    try:
        shipped = compile_kernels(out)
    except (ArtifactError, subprocess.TimeoutExpired) as err:
        log.warning("the artifact in %s ships no Triton kernels and was not trial-loaded: %s", out, err)
        return
    timer.done("trial_load")
    _add_files(out, timer, shipped, lambda manifest: manifest.update(kernels=KERNELS))


def _add_files(out: Path, timer: PhaseTimer, files: list[str], note: Callable[[dict], None]) -> None:
    """Rewrite the written artifact's manifest with ``files`` hashed in, ``note`` applied (where they are named)
    and the export's phase times so far."""
    manifest = read(out)
    manifest["files"].update(hash_files(out, files))
    note(manifest)
    manifest["export_seconds"] = timer.seconds
    write(out, manifest)


def _save_program(ep: torch.export.ExportedProgram, target: Path) -> None:
    """torch.export.save without the weights (they live in weights.safetensors): parameters become meta."""
    saved = dict(ep.state_dict)
    try:
        for name, value in saved.items():
            meta = torch.empty_like(value, device="meta")
            ep.state_dict[name] = nn.Parameter(meta, requires_grad=False) if isinstance(value, nn.Parameter) else meta
        torch.export.save(ep, str(target))
    finally:
        ep.state_dict.update(saved)


def _save_weights(programs, target: Path) -> dict[str, Any]:
    """Every weight and constant the programs read, once (names of one tensor become aliases); returns the
    manifest's weights entry."""
    from safetensors.torch import save_file

    named: dict[str, torch.Tensor] = {}
    for ep in programs:
        named.update(ep.state_dict)
        named.update({k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name in sorted(named):
        t = named[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = t.detach().to("cpu").contiguous()
    save_file(stored, str(target))
    return {"file": target.name, "aliases": aliases}


__all__ = ["ArtifactError", "export", "load"]
