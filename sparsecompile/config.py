"""Options, in one place: the engine, serving and method config dataclasses and the rules that route options.

Every option a user can pass is a field of one of three kinds of dataclass:

* :class:`EngineConfig`: how a patched model runs (pages, prefill chunks, compilation); ``optimize()`` takes it.
* :class:`ServingConfig`: the serving runtime over it (batch size, token budget, KV memory); ``LLM`` and
  ``sparsecompile serve`` take it as well.
* :class:`ServerConfig`: the OpenAI-compatible HTTP server over that runtime (bind address, API key, limits).
* one :class:`MethodConfig` subclass per sparse method (``methods/<name>.py``).

``optimize``, ``LLM`` and the CLI derive what they accept from these fields (:func:`split_options`,
``cli_flags.add_arguments``), so an option is declared once, with its default and help text (:func:`option`).
This module imports nothing of the package (floor 0): every floor may read it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

OPTION_KINDS = ("engine", "serving", "method")


def cache_root() -> Path:
    """Root of sparsecompile's on-disk caches (``$SPARSECOMPILE_CACHE``, else ``$XDG_CACHE_HOME/sparsecompile`` or
    ``~/.cache/sparsecompile``): the converted default model, compile caches."""
    env = os.environ.get("SPARSECOMPILE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparsecompile"


class MethodConfigError(ValueError):
    """An option is unknown or out of range; the message says what to change."""


def option(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 (argparse's name)
    """A dataclass field with its help text (read by the CLI and by error messages)."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def _described(value: Any) -> str:
    """``value`` for a message; a string that holds a number says so (``page_size="16"``: pass the int)."""
    if isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            return repr(value)
        return f"the string {value!r} (pass the number {number}, not a string)"
    return repr(value)


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MethodConfigError(f"{name} must be a positive integer, got {_described(value)}")


# ---------------------------------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    """Engine options shared by ``optimize()`` and the serving runtime."""

    page_size: int = option(16, "tokens per KV page (a power of two)")
    prefill_chunk_size: int | None = option(None, "prompt tokens per prefill forward; 0 = whole prompt; default: "
                                                  "the method's (whole prompt; H2O 8192), when serving at most "
                                                  "max_num_batched_tokens (default 8192)")
    compile: bool | str = option("auto", "compile decode steps with torch.compile (auto: on CUDA only)")
    cuda_graphs: bool | str = option("auto", "replay compiled decode steps as CUDA graphs (auto: when compiling "
                                             "on CUDA)")
    num_pages: int | None = option(None, "fixed KV pool size in pages (default: sized from the method's memory "
                                         "oracle and grown on demand)")
    show_progress: bool = option(False, "a progress bar over prefill chunks")
    prefill_mlp_chunk: int = option(16384, "tokens per MLP call in a longer prefill forward (attention still sees "
                                           "the whole chunk): caps the MLP's activations; 0 = one call")
    fuse_pointwise: bool = option(True, "eager (prefill) forwards on CUDA in bf16 / fp16 run each Llama-style "
                                        "RMSNorm and the MLP's silu(gate) * up as one kernel (decode steps are "
                                        "compiled and fused by inductor)")
    fuse_projections: bool = option(True, "compiled decode runs each layer's q/k/v and gate/up projections as one "
                                          "GEMM per group")
    compile_cache: bool = option(True, "keep inductor's compiled graphs and kernels on disk (under the sparsecompile "
                                       "cache directory), so a new process starts warm")
    tp_size: int = option(1, "tensor-parallel ranks the model is split over (heads, KV heads, MLP columns); > 1 runs "
                             "inside a torchrun job of that many processes")
    tp_timeout: float = option(600.0, "seconds a tensor-parallel collective waits for the other ranks before the "
                                      "job stops")

    def __post_init__(self) -> None:
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1 \
                or self.page_size & (self.page_size - 1):
            raise MethodConfigError(f"page_size must be a positive power of two (an int), got "
                                    f"{_described(self.page_size)}")
        if self.prefill_chunk_size is not None and (isinstance(self.prefill_chunk_size, bool)
                                                    or not isinstance(self.prefill_chunk_size, int)
                                                    or self.prefill_chunk_size < 0):
            raise MethodConfigError(f"prefill_chunk_size must be an int >= 0 (0 = whole prompt), "
                                    f"got {_described(self.prefill_chunk_size)}")
        for name in ("compile", "cuda_graphs"):
            if getattr(self, name) not in (True, False, "auto"):
                raise MethodConfigError(f"{name} must be True, False or 'auto', got {getattr(self, name)!r}")
        _positive_int("num_pages", self.num_pages, allow_none=True)
        if self.prefill_mlp_chunk != 0:
            _positive_int("prefill_mlp_chunk", self.prefill_mlp_chunk)
        if not isinstance(self.fuse_pointwise, bool):
            raise MethodConfigError(f"fuse_pointwise must be True or False, got {_described(self.fuse_pointwise)}")
        _positive_int("tp_size", self.tp_size)
        t = self.tp_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise MethodConfigError(f"tp_timeout must be a positive number of seconds, got {t!r}")


# ---------------------------------------------------------------------------------------------------- serving
@dataclass
class ServingConfig:
    """Options of the serving runtime (``sparsecompile.LLM``, ``sparsecompile serve``), vLLM's names."""

    max_num_seqs: int = option(64, "most requests running at once (the decode batch)")
    max_num_batched_tokens: int | None = option(None, "tokens per engine step, decode tokens plus prompt chunks "
                                                      "(default: the prefill chunk)")
    max_prefill_tokens_while_decoding: int | None = option(
        None, "prompt tokens a step carries while requests decode (default: the whole step budget); lower keeps "
              "running streams' inter-token latency near a decode step's during a burst of new prompts, at the cost "
              "of those prompts' time to first token (fixed-size chunks, H2O's, still run one per step)")
    enable_mixed_chunk: bool = option(True, "run a step's decode tokens and all its prompt chunks in one forward (as "
                                            "vLLM batches; SGLang's --enable-mixed-chunk); off: one forward for the "
                                            "decodes, then one per group of chunks of similar lengths")
    mixed_cuda_graphs: bool = option(True, "record each shape of mixed step (decodes and prompt chunks in one "
                                           "forward) as a CUDA graph at its second occurrence and replay it after, "
                                           "for methods whose hooks allow it (vanilla, quest, omnikv; with "
                                           "cuda_graphs on a GPU); off: every mixed step runs its forward op by op")
    compile_prefill: bool = option(False, "compile the decoder layers of prefill and mixed-step forwards (one "
                                          "graph for every layer and token count; each layer's attention stays the "
                                          "eager method path, one opaque op): less host time per step, for one "
                                          "compile of a layer at the first prompt")
    kv_cache_memory: float | None = option(None, "KV pool size: bytes, or a fraction of the GPU memory free after "
                                                 "loading (default 0.85 on CUDA, 1 GiB on CPU)")
    gpu_memory_utilization: float | None = option(None, "fraction of the GPU's total memory the process may use "
                                                        "(weights, activations and KV pool), as vLLM counts it")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's maximum)")
    cuda_graph_sizes: list[int] | None = option(None, "decode batch sizes compiled and graph-captured (default: "
                                                      "powers of two up to max_num_seqs)")
    model_name: str | None = option(None, "the model id clients send (default: the model path)")
    enable_prefix_caching: bool = option(False, "share full KV pages of common prompt prefixes between requests "
                                                "(methods that keep every token: vanilla, quest, omnikv)")
    max_idle_chains: int | None = option(None, "idle chains (per-conversation KV kept between turns, requests with a "
                                               "chain_id) held at most; least recently used freed first (default: "
                                               "max_num_seqs)")
    seed: int | None = option(None, "default sampling seed for requests that set none: the engine's n-th such "
                                    "request samples with seed + n, so a rerun gives the same tokens (default: "
                                    "unseeded)")
    tensor_parallel_size: int = option(1, "GPUs (ranks) one model is split over; the engine starts the other ranks' "
                                          "worker processes itself (or joins a torchrun job of that size)")

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("enable_mixed_chunk", "mixed_cuda_graphs", "compile_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise MethodConfigError(f"{name} must be True or False, got {_described(getattr(self, name))}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise MethodConfigError(f"seed must be an integer or None, got {_described(self.seed)}")
        if self.max_idle_chains is not None and (isinstance(self.max_idle_chains, bool)
                                                 or not isinstance(self.max_idle_chains, int)
                                                 or self.max_idle_chains < 0):
            raise MethodConfigError(f"max_idle_chains must be an integer >= 0, got {_described(self.max_idle_chains)}")
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _positive_int("max_prefill_tokens_while_decoding", self.max_prefill_tokens_while_decoding, allow_none=True)
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.compile_prefill and self.tensor_parallel_size > 1:  # ranks must run the same forwards' collectives
            raise MethodConfigError("compile_prefill is not supported with tensor_parallel_size > 1 yet (the worker "
                                    "ranks run eager forwards); leave it off under tensor parallelism")
        if self.kv_cache_memory is not None and self.gpu_memory_utilization is not None:
            raise MethodConfigError("pass kv_cache_memory or gpu_memory_utilization, not both")
        mem = self.kv_cache_memory
        if mem is not None and (isinstance(mem, bool) or not isinstance(mem, (int, float)) or mem <= 0):
            raise MethodConfigError(f"kv_cache_memory must be bytes (> 1) or a fraction in (0, 1], got {mem!r}")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1):
            raise MethodConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {util!r}")
        if self.cuda_graph_sizes is not None:
            for size in self.cuda_graph_sizes:
                _positive_int("every cuda_graph_sizes entry", size)


# ---------------------------------------------------------------------------------------------------- server
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServerConfig:
    """Options of the OpenAI-compatible HTTP server (``sparsecompile serve``, ``sparsecompile.server``)."""

    host: str = option("127.0.0.1", "bind address")
    port: int = option(8000, "port")
    served_model_name: str | None = option(None, "model id clients send and /v1/models lists (default: the model "
                                                 "as given, or the embedded model's name)")
    api_key: str | None = option(None, "require 'Authorization: Bearer <key>' on every /v1 route (default: the "
                                       "environment variable SPARSECOMPILE_API_KEY; /health and /metrics stay open)")
    allowed_hosts: list[str] | None = option(None, "Host header values accepted on /v1 routes, against DNS "
                                                   "rebinding ('*' = any; default: the bind address, localhost, "
                                                   "127.0.0.1 and [::1])")
    max_request_bytes: int = option(8 << 20, "largest request body in bytes; larger ones get 413 before they are "
                                             "read")
    read_timeout: float = option(30.0, "seconds a client may take to send a request's head, and again its body; "
                                       "slower connections are closed (408 for a body)")
    chat_template: str | None = option(None, "chat template for /v1/chat/completions: a file or a Jinja string "
                                             "(default: the tokenizer's)")
    uvicorn_log_level: str = option("info", f"uvicorn log level: {', '.join(UVICORN_LOG_LEVELS)}")

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise MethodConfigError(f"port must be in 0..65535 (0 = any free port), got {self.port!r}")
        _positive_int("max_request_bytes", self.max_request_bytes)
        timeout = self.read_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise MethodConfigError(f"read_timeout must be a number of seconds > 0, got {timeout!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise MethodConfigError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, "
                                    f"got {self.uvicorn_log_level!r}")
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str) or any(not isinstance(h, str) or not h for h in self.allowed_hosts):
                raise MethodConfigError(f"allowed_hosts must be a list of host names, got {self.allowed_hosts!r}")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise MethodConfigError("api_key must be a string")


# ---------------------------------------------------------------------------------------------------- methods
@dataclass
class MethodConfig:
    """Base of every method config; subclasses add fields (with :func:`option`) and check them in ``validate``."""

    #: the method's name, used in messages
    method: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`MethodConfigError` for out-of-range options."""

    @classmethod
    def option_names(cls) -> list[str]:
        return field_names(cls)

    @classmethod
    def text_options(cls) -> dict[str, str]:
        """Token-id options whose default is a text: ``{option: text}``. A caller holding a tokenizer
        (``sparsecompile.LLM``) fills each one left unset with the text's ids (no special tokens added)."""
        return {}

    @classmethod
    def from_options(cls, method: str, options: dict[str, Any]) -> MethodConfig:
        unknown = sorted(set(options) - set(cls.option_names()))
        if unknown:
            valid = ", ".join(cls.option_names()) or "(none)"
            raise MethodConfigError(f"unknown option(s) {', '.join(unknown)} for method {method!r}; "
                                    f"valid options: {valid}")
        return cls(**options)


# ---------------------------------------------------------------------------------------------------- aliases
@dataclass(frozen=True)
class Alias:
    """Another project's name for one of our options, so code written for it runs unchanged.

    ``convert`` maps a value in that project's convention to ours; ``conflicts`` names options it cannot be
    given with (its target always conflicts); ``scope`` restricts it to one group of methods (the caller says
    which methods are in each group), None to any method.
    """

    target: str
    origin: str
    convert: Callable[[Any], Any] | None = None
    conflicts: tuple[str, ...] = ()
    scope: str | None = None


def _kept_fraction(compression_ratio: Any) -> float:
    """kvpress' ``compression_ratio`` (the fraction of the prompt removed) as our ``ratio`` (the fraction kept).

    ``1 - compression_ratio`` in float, as kvpress computes ``n_kept = int(q_len * (1 - compression_ratio))``.
    """
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)) \
            or not 0 <= compression_ratio < 1:
        raise MethodConfigError(f"compression_ratio (kvpress: the fraction of the prompt removed) must be in [0, 1), "
                                f"got {_described(compression_ratio)}")
    return 1 - compression_ratio


#: the one table of option aliases: their name -> ours (read by :func:`split_options`)
OPTION_ALIASES: dict[str, Alias] = {
    "block_size": Alias("page_size", "vLLM's name for page_size"),
    "compression_ratio": Alias("ratio", "kvpress' fraction of the prompt removed (ratio = 1 - compression_ratio)",
                               _kept_fraction, conflicts=("budget",), scope="eviction"),
}

#: ``dtype`` names accepted by ``LLM`` and the CLI (vLLM's): name -> torch attribute (None: "auto", the device's
#: default: bfloat16 on CUDA, float32 on CPU)
DTYPE_NAMES: dict[str, str | None] = {"auto": None, "float32": "float32", "float": "float32",
                                      "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


def dtype_attribute(name: str) -> str | None:
    """The torch attribute for a dtype name of :data:`DTYPE_NAMES` (None for "auto"); clear error otherwise."""
    if not isinstance(name, str) or name.lower() not in DTYPE_NAMES:
        raise MethodConfigError(f"dtype must be a torch.dtype or one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return DTYPE_NAMES[name.lower()]


def resolve_aliases(options: dict[str, Any], method: str,
                    scopes: Mapping[str, Collection[str]] | None = None) -> dict[str, Any]:
    """``options`` with every alias of :data:`OPTION_ALIASES` replaced by its target (value converted).

    ``scopes`` maps a scope name to the methods in it. Raises :class:`MethodConfigError` when an alias is given
    with its target or a conflicting option, or for a method outside its scope.
    """
    resolved = {name: value for name, value in options.items() if name not in OPTION_ALIASES}
    for name, value in options.items():
        alias = OPTION_ALIASES.get(name)
        if alias is None:
            continue
        if alias.scope is not None:
            members = sorted((scopes or {}).get(alias.scope, ()))
            if method not in members:
                raise MethodConfigError(f"{name!r} ({alias.origin}) applies to the {alias.scope} methods "
                                        f"({', '.join(members) or 'none registered'}), not to {method!r}")
        clashes = [other for other in (alias.target, *alias.conflicts) if other in options]
        if clashes:
            raise MethodConfigError(f"{name!r} ({alias.origin}) cannot be given with {', '.join(map(repr, clashes))}; "
                                    f"pass one of {', '.join(repr(o) for o in (name, alias.target, *alias.conflicts))}")
        resolved[alias.target] = alias.convert(value) if alias.convert is not None else value
    return resolved


# ---------------------------------------------------------------------------------------------------- routing
def split_options(options: dict[str, Any], method: str, method_options: Iterable[str],
                  accepted: tuple[str, ...] = OPTION_KINDS,
                  owners: Callable[[str], list[str]] | None = None,
                  scopes: Mapping[str, Collection[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Route ``options`` to ``{"engine": ..., "serving": ..., "method": ...}`` by the dataclass that declares each.

    Aliases (:data:`OPTION_ALIASES`) are resolved first (``scopes``: see :func:`resolve_aliases`).
    ``accepted`` names the kinds the caller takes (``optimize()`` takes no serving options); ``owners(name)``
    lists the methods that declare an option (for the message when ``method`` does not). Raises
    :class:`MethodConfigError` naming, for each refused option, which kind it was taken for and what to do.
    """
    options = resolve_aliases(options, method, scopes)
    kinds = {"engine": set(field_names(EngineConfig)), "serving": set(field_names(ServingConfig)),
             "method": set(method_options)}
    routed: dict[str, dict[str, Any]] = {kind: {} for kind in OPTION_KINDS}
    problems = []
    for name, value in options.items():
        kind = next((k for k in OPTION_KINDS if name in kinds[k]), None)
        if kind is None:
            other = owners(name) if owners else []
            if other:
                problems.append(f"{name!r} is an option of method(s) {', '.join(other)}, not of {method!r}")
            else:
                problems.append(f"unknown option {name!r} (not an engine, serving or {method!r} method option)")
        elif kind not in accepted:
            problems.append(f"{name!r} is a {kind} option, which this call does not take (serving options go to "
                            "sparsecompile.LLM or `sparsecompile serve`)")
        else:
            routed[kind][name] = value
    if problems:
        valid = "; ".join(f"{k}: {', '.join(sorted(kinds[k])) or '(none)'}" for k in accepted)
        raise MethodConfigError("; ".join(problems) + f"; valid options: {valid}")
    return routed
