"""Serving an exported artifact: its programs and weights under a KV core built from its manifest.

``sparsecompile.export`` writes two programs (``models/export_programs.py``): a **prefill** forward whose attention
layers call back into the live SparseController (``sparsecompile::attend``), and a **decode step** with the method
traced in, over the pool, tables, slot counts and method buffers as mutated inputs. Here they become a
:class:`~sparsecompile.serving.interface.ServedModel` for the ordinary :class:`LLMEngine`:

* the KV core (ModelInfo, method runtime, SparseController, EngineConfig) is rebuilt from the manifest, so the
  host-side lifecycle (page allocation, flush, prepare / commit, eviction plans, scheduling) is the same Python
  code as for an optimized HF model; no HF modeling code is imported;
* the prefill program is the engine's ``inner`` forward, run with the controller current (``attend_op.serving``);
* the decode program is installed as the controller's decode step (``install_decode_step``); on CUDA one graph
  per batch bucket is captured at load over padding-only steps (they read and write nothing), so serving never
  captures on live data and replays run no host code between kernels;
* weights are loaded once from ``weights.safetensors`` and handed to every program without copies (AOTI
  user-managed constants; the fallback form attaches them to the exported programs' parameters).

The fallback form (``form="exported"``, for hosts where AOTInductor packages cannot load) ships the two
``torch.export`` programs instead; they run eagerly, or compiled at load when the artifact carries the compile
cache (``torch.compiler`` cache artifacts) that makes that compile warm.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig, ServingConfig
from ..methods import build_runtime
from ..runtime.attend_op import serving
from ..runtime.compilation import apply_deferred_marks, wanted
from ..runtime.controller import SparseController
from ..runtime.model_info import ModelInfo
from ..runtime.state_binding import POOL_PREFIXES, StateSlot, decode_state, state_tensors
from .aoti_linkage import check_package
from .artifact_kernels import install_kernels
from .engine import LLMEngine
from .manifest import ArtifactError, check, read
from .weights_file import load_safetensors

log = logging.getLogger(__name__)

#: serving options fixed by the exported decode program (its block table and method buffers have their shapes)
FIXED_SERVING = ("max_num_seqs", "max_model_len")
LOAD_OPTIONS = ("kv_cache_memory", "gpu_memory_utilization", "max_num_batched_tokens",
                "max_prefill_tokens_while_decoding", "cuda_graph_sizes", "model_name", "num_pages", "show_progress")


def load_weights(root: Path, manifest: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Every program weight by name, on ``device`` (tied names share one tensor)."""
    spec = manifest["weights"]
    stored = load_safetensors(root / spec["file"], device)
    for alias, name in spec.get("aliases", {}).items():
        stored[alias] = stored[name]
    return stored


def load_tokenizer(directory: Path, class_path: str | None):
    """The artifact's tokenizer, through the class export recorded ("module:name", a transformers class).

    Importing that class's module alone is cheap; ``transformers.AutoTokenizer`` (transformers 5.17) imports the
    auto-model factory and with it generation, masking, FSDP, torch._dynamo and sklearn: 9.4 s on the H200 host,
    7.6 s of a 12.2 s load of the 8B artifact (``results/export_h200_tokenizer_import.txt``). Falls back to
    AutoTokenizer for an older artifact or a transformers without that class."""
    module, _, name = (class_path or "").partition(":")
    if module.startswith("transformers."):
        try:
            tokenizer_class = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            log.info("tokenizer class %s is not in this transformers: loading through AutoTokenizer", class_path)
        else:
            return tokenizer_class.from_pretrained(str(directory), local_files_only=True)
    from transformers import AutoTokenizer  # tokenizers only: no modeling code

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


class AOTIProgram:
    """An AOTInductor package run with the caller's weights (user-managed constants: shared, never copied)."""

    def __init__(self, path: Path, device: torch.device, weights: dict[str, torch.Tensor],
                 single_threaded: bool) -> None:
        device = torch.device(device)
        index = -1
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        check_package(path)  # a package with its own libstdc++ would crash this process (aoti_linkage.py)
        # The loader class itself: torch._inductor.aoti_load_package first reads the archive as a general pt2
        # file (seconds on a large package) before building this same loader.
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", single_threaded, 1, index)
        names = self.loader.get_constant_fqns()
        missing = [n for n in names if n not in weights]
        if missing:
            raise ArtifactError(f"{path.name} needs weights the artifact does not hold: {missing[:5]}")
        constants = {n: weights[n] for n in names}
        try:
            self.loader.load_constants(constants, False, True, True)  # use_inactive, check_full_update, user_managed
        except TypeError:  # a torch without user-managed constants: the loader keeps its own copy
            log.warning("this torch copies AOTI constants (no user-managed weights): weights use twice the memory")
            self.loader.load_constants(constants, False, True)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.loader.run(inputs)


class ExportedProgramRunner:
    """The fallback form: a ``torch.export`` program with the artifact's weights as its parameters.

    ``leading``: the program takes that many tensors, then the rest as one tuple (the decode step's state).
    ``compile``: None (run the program as it is) or the inductor options to compile it with (the manifest's); it
    then starts warm from the shipped cache artifacts, made by a fresh process that compiled the same graph with
    the same options and dynamic dims (``dynamic`` lists the flat inputs whose first dimension is the pool's page
    count).
    """

    def __init__(self, path: Path, weights: dict[str, torch.Tensor], leading: int | None,
                 compile: dict[str, Any] | None = None, dynamic: list[int] | None = None) -> None:
        ep = torch.export.load(str(path))
        for name, placeholder in list(ep.state_dict.items()):
            if name not in weights:
                raise ArtifactError(f"{path.name} needs the weight {name}, which the artifact does not hold")
            tensor = weights[name]
            ep.state_dict[name] = (torch.nn.Parameter(tensor, requires_grad=False)
                                   if isinstance(placeholder, torch.nn.Parameter) else tensor)
        module = ep.module()
        if compile is not None:
            apply_deferred_marks()
        self.fn = module if compile is None else torch.compile(module, fullgraph=True, options=compile)
        self.leading = leading
        self.dynamic = list(dynamic or [])

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.dynamic:  # any pool size, one graph per batch bucket (the order buckets arrive in does not matter)
            for index, tensor in enumerate(inputs):
                if index in self.dynamic:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
                elif index < (self.leading or 0):
                    torch._dynamo.mark_static(tensor, 0)
        args = inputs if self.leading is None else [*inputs[: self.leading], tuple(inputs[self.leading:])]
        with torch.no_grad():
            out = self.fn(*args)
        return [out] if isinstance(out, torch.Tensor) else list(out)


def open_program(root: Path, manifest: dict[str, Any], name: str, device: torch.device,
                 weights: dict[str, torch.Tensor], single_threaded: bool = False):
    spec = manifest["programs"][name]
    path = root / spec["file"]
    if manifest["form"] == "aoti":
        return AOTIProgram(path, device, weights, single_threaded)
    cache = spec.get("compile_cache")
    if cache:
        torch.compiler.load_cache_artifacts((root / cache).read_bytes())
    leading = len(spec["inputs"]) if "state" in spec else None
    return ExportedProgramRunner(path, weights, leading, spec.get("inductor"), per_page_inputs(spec))


def per_page_inputs(spec: dict[str, Any]) -> list[int]:
    """Flat input indices of a decode program whose first dimension is the pool's page count."""
    lead = len(spec["inputs"])
    return [lead + i for i, name in enumerate(spec.get("state", [])) if name.startswith(POOL_PREFIXES)]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    step: Any  # the StepState captured (persistent per batch size)
    input_ids: torch.Tensor
    logits: torch.Tensor
    state_ptrs: list[int]


class ArtifactDecode:
    """The controller's decode step over the decode program: ``(inner, step, input_ids, positions) -> logits``.

    Replays the bucket's CUDA graph when one was captured for this step (and the state tensors are the ones it
    captured); otherwise runs the program directly.
    """

    def __init__(self, program, controller: SparseController, state_names: list[str],
                 capture_live: bool = False) -> None:
        self.program = program
        self.controller = controller
        self.state_names = list(state_names)
        self.slots: list[StateSlot] | None = None
        self.graphs: dict[int, _Graph] = {}
        self._capture = False
        self._pool = None
        # capture a batch size's graph at its first real step (optimize()'s precompiled decode programs: generate()
        # knows no buckets ahead); an artifact captures over padding steps at load instead (capture())
        self.capture_live = capture_live and controller.layout.device.type == "cuda"

    def bind_state(self) -> None:
        """Resolve the state the program takes against this process's KV core (after the pool exists)."""
        here = {slot.name: slot for slot in decode_state(self.controller)}
        missing = [name for name in self.state_names if name not in here]
        if missing:
            raise ArtifactError(f"the artifact's decode program takes the state {missing}, which the KV core built "
                                f"here does not hold (it holds {sorted(here)}); export it again with this version")
        self.slots = [here[name] for name in self.state_names]

    def _inputs(self, step, input_ids: torch.Tensor) -> list[torch.Tensor]:
        if self.slots is None:
            self.bind_state()
        return [input_ids, step.positions, step.rows, step.new_offsets, step.num_new, *state_tensors(self.slots)]

    def __call__(self, inner, step, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self._capture:
            return self._record(step, input_ids)
        graph = self.graphs.get(input_ids.shape[0])
        if graph is not None and (graph.step is not step
                                  or [t.data_ptr() for t in state_tensors(self.slots)] != graph.state_ptrs):
            if not self.capture_live:
                log.warning("the KV state or the decode step moved since the decode graphs were captured; running "
                            "the program directly")
            self.graphs.clear()  # (the pool grew, or a new step object: a capture_live step records it again)
            graph = None
        if graph is not None:
            graph.input_ids.copy_(input_ids)
            graph.graph.replay()
            return graph.logits
        if self.capture_live:
            return self._record(step, input_ids)
        with torch.no_grad():
            return self.program(self._inputs(step, input_ids))[0]

    def warm_up(self) -> None:
        """One decode step of padding rows only (nothing is read or written: the padding row holds no slot). The
        step's host hooks create the method's lazily sized buffers (Quest's and OmniKV's read counters), then the
        program's state binds to them: a state this KV core does not hold fails the load, not the first request."""
        self.padding_steps([1])

    def capture(self, buckets: list[int]) -> None:
        """One CUDA graph per decode batch size, recorded over padding-only steps (as :meth:`warm_up`), largest
        first, sharing one memory pool."""
        self._pool = torch.cuda.graph_pool_handle()
        self._capture = True
        try:
            self.padding_steps(sorted(set(buckets), reverse=True))
        finally:
            self._capture = False

    def padding_steps(self, batches: list[int]) -> None:
        """One decode step of padding rows at each batch size of ``batches`` (binds the state on the first)."""
        empty = torch.zeros(0, 1, dtype=torch.long, device=self.controller.layout.device)
        for batch in batches:
            self.controller.decode(None, [], empty, empty, pad_to=batch)

    def _record(self, step, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the step once (outside any graph: kernel loading, allocator; this run is the step's effect and its
        logits are returned), then record it into the batch size's graph (recording runs nothing)."""
        inputs = self._inputs(step, input_ids.clone())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            logits = self.program(inputs)[0]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
            replayed = self.program(inputs)[0]
        self.graphs[input_ids.shape[0]] = _Graph(graph, step, inputs[0], replayed, [t.data_ptr() for t in inputs[5:]])
        return logits


class ArtifactModel:
    """The :class:`ServedModel` of an artifact: its prefill program as the engine's forward."""

    def __init__(self, controller: SparseController, prefill, manifest: dict[str, Any]) -> None:
        model = manifest["model"]
        self.controller = controller
        self.prefill = prefill
        self.max_length = model["max_length"]
        self.vocab_size = model["vocab_size"]
        self.name = model.get("name")
        self.eos_token_ids = set(model.get("eos_token_ids") or [])

    def inner(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, position_ids: torch.Tensor,
              logits_to_keep: int) -> torch.Tensor:
        if input_ids is None or inputs_embeds is not None:
            raise ArtifactError("an exported artifact takes token ids (no inputs_embeds)")
        tokens = input_ids.shape[1]
        first = 0 if logits_to_keep == 0 else max(0, tokens - logits_to_keep)  # HF's convention: 0 keeps all
        keep = torch.arange(first, tokens, device=input_ids.device)
        with serving(self.controller), torch.no_grad():
            return self.prefill([input_ids.contiguous(), position_ids.contiguous(), keep])[0]


def _serving_config(manifest: dict[str, Any], overrides: dict[str, Any]) -> ServingConfig:
    built = manifest["serving"]
    for name in FIXED_SERVING:
        if name in overrides and overrides[name] is not None and overrides[name] != built[name]:
            raise ArtifactError(f"{name}={overrides[name]} differs from the artifact's {name}={built[name]}: the "
                                f"decode program was exported for it; export again with {name}={overrides[name]}")
    values = {f.name: built.get(f.name) for f in fields(ServingConfig) if f.name in built}
    values.update({k: v for k, v in overrides.items() if k in {f.name for f in fields(ServingConfig)}})
    sizes = values.get("cuda_graph_sizes")
    if sizes and max(sizes) > built["max_num_seqs"]:
        raise ArtifactError(f"cuda_graph_sizes {sizes} exceed the artifact's max_num_seqs={built['max_num_seqs']}")
    return ServingConfig(**values)


class PhaseTimer:
    """Seconds per phase of a load (``engine.load_timings``) or an export (the manifest's ``export_seconds``); on
    CUDA a phase ends with a synchronize, so its copies and kernels count in the phase that issued them."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 3)
        self._last = now


def load_engine(path: str | Path, *, device: str | torch.device | None = None, verify: bool = True,
                **options: Any) -> LLMEngine:
    """An :class:`LLMEngine` over the artifact in ``path`` (see module docstring).

    ``options``: serving / engine options that do not change the programs (``kv_cache_memory``,
    ``gpu_memory_utilization``, ``num_pages``, ``max_num_batched_tokens``, ``cuda_graph_sizes``, ``model_name``,
    ``show_progress``); ``max_num_seqs`` and ``max_model_len`` must equal the exported ones. ``verify=False``
    skips hashing the artifact's files (the version and GPU checks still run). ``engine.load_timings``: seconds
    per phase (checks, kernels, kv_core, weights, prefill_program, decode_program, tokenizer, engine, then
    cuda_graphs or warm_up).
    """
    timer = PhaseTimer()
    root = Path(path)
    manifest = read(root)
    unknown = sorted(set(options) - set(LOAD_OPTIONS) - set(FIXED_SERVING))
    if unknown:
        raise ArtifactError(f"option(s) {unknown} cannot change at load (the programs were exported with them); "
                            f"load takes {', '.join(LOAD_OPTIONS)}")
    device = torch.device(device or manifest["device"]["type"])
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    timer.device = device
    check(manifest, root, device, verify_files=verify)
    timer.done("checks")
    install_kernels(root, manifest)  # before any step: sparsecompile's own Triton kernels, compiled at export
    timer.done("kernels")
    info_spec = manifest["model"]["info"]
    info = ModelInfo(**{**info_spec, "attention_paths": tuple(info_spec["attention_paths"])})
    runtime = build_runtime(manifest["method"]["name"], manifest["method"]["options"], info)
    engine_options = {**manifest["engine"], "compile": False}
    engine_options.update({k: options[k] for k in ("num_pages", "show_progress") if k in options})
    engine_config = EngineConfig(**engine_options)
    dtype = getattr(torch, manifest["model"]["dtype"])
    controller = SparseController(runtime, info.num_layers, info.num_kv_heads, info.head_dim, dtype, device,
                                  engine_config)
    timer.done("kv_core")
    weights = load_weights(root, manifest, device)
    timer.done("weights")
    prefill = open_program(root, manifest, "prefill", device, weights)
    timer.done("prefill_program")
    decode = ArtifactDecode(open_program(root, manifest, "decode", device, weights, single_threaded=True),
                            controller, manifest["programs"]["decode"]["state"])
    controller.install_decode_step(decode, variants=False)  # traced in the default variant only
    timer.done("decode_program")
    tokenizer = load_tokenizer(root / manifest["tokenizer"], manifest.get("tokenizer_class"))
    timer.done("tokenizer")
    engine = LLMEngine(ArtifactModel(controller, prefill, manifest), tokenizer,
                       _serving_config(manifest, {k: v for k, v in options.items() if k not in ("num_pages",
                                                                                                "show_progress")}))
    timer.done("engine")
    if device.type == "cuda" and wanted(manifest["engine"].get("cuda_graphs", "auto"), device):
        decode.capture(engine.graph_sizes)  # binds the program's state, as warm_up does
        timer.done("cuda_graphs")
    else:
        decode.warm_up()
        timer.done("warm_up")
    engine.load_timings = timer.seconds
    log.info("loaded %s in %.1f s (%s)", root, sum(timer.seconds.values()),
             ", ".join(f"{k} {v:.2f} s" for k, v in timer.seconds.items()))
    engine.artifact_manifest = manifest
    return engine
