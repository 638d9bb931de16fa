"""Command line: ``sparsecompile generate | serve | warmup | export | bench``.

Every engine, serving and method flag is derived from the config dataclasses (``sparsecompile/config.py`` and
each method's config), with their help text and defaults, so a new option needs no CLI code. The top-level
``--help`` does not import torch; subcommands that list method flags import the method registry. Argument
errors that need no model are reported before torch is imported: a first pass parses the command line without
the method flags (``parse_known_args``) and checks the values; then the method and engine options are built
into their configs before the model loads. Every error is one line, without a traceback. The parser and
``main`` live here; the subcommands' bodies in :mod:`sparsecompile.cli_commands`.
"""

from __future__ import annotations

import argparse
import sys

from .cli_commands import COMMANDS, check_generate, cmd_bench
from .cli_flags import add_arguments, parse_bool
from .config import DTYPE_NAMES, EngineConfig, ServerConfig, ServingConfig


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line (the usage of a subcommand with every method flag runs to pages)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _auto_or_bool(text: str) -> bool | str:
    return "auto" if text.lower() == "auto" else parse_bool(text)


def _parse_memory(text: str) -> float:
    """``--kv-cache-memory``: bytes (``4e9``, ``512MiB``, ``8GB``) or a fraction of free GPU memory (``0.8``)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    lowered = text.strip().lower()
    for suffix, scale in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if lowered.endswith(suffix):
            number, multiplier = lowered[: -len(suffix)], scale
            break
    else:
        number, multiplier = lowered, 1
    try:
        value = float(number) * multiplier
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 4GiB, 512MiB, 4e9) or a fraction in (0, 1], "
                                         f"got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--kv-cache-memory must be > 0, got {text!r}")
    return value


def _parse_bytes(text: str) -> int:
    """``--max-request-bytes``: a byte count (``8MiB``, ``4e6``, ``1048576``)."""
    value = _parse_memory(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte count (e.g. 8MiB), got {text!r}")
    return int(value)


_ENGINE_TYPES = {"compile": _auto_or_bool, "cuda_graphs": _auto_or_bool}


def _add_engine(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    engine = parser.add_argument_group("engine options (sparsecompile.config.EngineConfig)")
    add_arguments(engine, EngineConfig, skip=("show_progress",), types=_ENGINE_TYPES)
    return engine


def _add_methods(parser: argparse.ArgumentParser) -> None:
    """One flag per option of any registered method (methods share names such as --budget: the first wins)."""
    from .methods import available_methods, method_class

    group = parser.add_argument_group("method options (each applies to the methods that declare it)")
    seen: set[str] = set()
    for name in available_methods():
        add_arguments(group, method_class(name).config_class, dest_prefix="method_", seen=seen)
    parser.set_defaults(_method_options=sorted(seen))


def _add_model(parser: argparse.ArgumentParser, methods: list[str] | None) -> None:
    parser.add_argument("--model", default=None, help="HF model directory, .gguf file or Hugging Face model id (from "
                                                      "the local cache, or the hub when reachable; default: the "
                                                      "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--method", default="vanilla", choices=methods,
                        help="sparse method (default: vanilla)" + ("" if methods else "; see a subcommand's --help"))
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                        help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")


def build_parser(with_methods: bool = True) -> argparse.ArgumentParser:
    """The CLI parser; ``with_methods=False`` leaves out method flags (no torch import: instant top-level help)."""
    methods = None
    if with_methods:
        from .methods import available_methods

        methods = available_methods()
    parser = _Parser(prog="sparsecompile", description="sparse-first LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a sparse method (streamed to stdout as it comes) "
                                          "and print a KV-memory summary")
    _add_model(gen, methods)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file holding the prompt text (UTF-8)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate, >= 1 (default: 64)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, else > 0 (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default: 1, off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    gen.add_argument("--no-stream", action="store_true", help="print the text once generated instead of "
                                                              "streaming it")
    _add_engine(gen)
    if with_methods:
        _add_methods(gen)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API "
                                         "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory or .gguf file (same as --model)")
    _add_model(serve, methods)
    serve.add_argument("--artifact", default=None, metavar="DIR",
                       help="serve an artifact made by `sparsecompile export` (no model, method or engine flags: "
                            "they are in the artifact; serving options that do not change its programs still apply)")
    server = serve.add_argument_group("server options (sparsecompile.config.ServerConfig)")
    add_arguments(server, ServerConfig, types={"allowed_hosts": str, "max_request_bytes": _parse_bytes})
    server.add_argument("--log-level", dest="uvicorn_log_level", default=None, metavar="UVICORN_LOG_LEVEL",
                        help="same as --uvicorn-log-level")
    serving = serve.add_argument_group("serving options (sparsecompile.config.ServingConfig)")
    add_arguments(serving, ServingConfig, skip=("model_name",), types={"kv_cache_memory": _parse_memory})
    engine = _add_engine(serve)
    engine.add_argument("--block-size", dest="page_size", type=int, default=None, metavar="PAGE_SIZE",
                        help="same as --page-size (vLLM's name)")
    if with_methods:
        _add_methods(serve)

    warm = sub.add_parser("warmup", help="compile the decode step ahead of time (kept in the on-disk compile cache, so "
                                         "later processes start warm)")
    _add_model(warm, methods)
    warm.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="decode batch sizes (default: 1)")
    warm.add_argument("--prompt-len", type=int, default=1024, help="prompt length whose pool geometry to compile for "
                                                                   "(default: 1024)")
    warm.add_argument("--max-new-tokens", type=int, default=256, help="new tokens the pool is sized for (default: 256)")
    warm.add_argument("--programs", action="store_true", help="also precompile each batch size's decode step into an "
                      "AOTInductor package, which later processes load instead of tracing the step (minutes)")
    _add_engine(warm)
    if with_methods:
        _add_methods(warm)

    export = sub.add_parser("export", help="export a model and method as a compiled artifact directory (AOTInductor "
                                           "programs, weights, tokenizer, manifest) for `serve --artifact`")
    _add_model(export, methods)
    export.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    export.add_argument("--form", default="aoti", choices=["aoti", "exported"],
                        help="aoti: AOTInductor packages (default); exported: torch.export programs plus the decode "
                             "step's compile cache, for hosts where AOTI packages do not load")
    export.add_argument("--no-compile-cache", action="store_true",
                        help="with --form exported: ship no compile cache (the loader then runs the programs eagerly)")
    export.add_argument("--no-kernels", action="store_true",
                        help="on CUDA: skip the trial load that compiles and ships sparsecompile's Triton kernels "
                             "(the loading process then compiles them on first use)")
    exported = export.add_argument_group("serving options fixed in the artifact (max_num_seqs, max_model_len, "
                                         "cuda_graph_sizes; the KV memory is chosen at load)")
    add_arguments(exported, ServingConfig, skip=("model_name", "kv_cache_memory", "gpu_memory_utilization"))
    _add_engine(export)
    if with_methods:
        _add_methods(export)

    bench = sub.add_parser("bench", help="GPU benchmarks: decode against the HBM roofline (benchmarks/decode.py), "
                                         "--prefill (benchmarks/prefill.py), --user-path (generate() beside the engine "
                                         "step: benchmarks/user_path.py); CUDA only; their options follow",
                           add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)  # parsed by benchmarks/decode.py itself
    return parser


def _first_pass(argv: list[str]) -> None:
    """Parse without the method flags (no torch import) and check what needs no model: instant errors."""
    light = build_parser(with_methods=False)
    args, _ = light.parse_known_args(argv)
    if args.command == "generate":
        try:
            check_generate(args)
        except ValueError as err:
            light.exit(2, f"sparsecompile generate: error: {err}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    top_level = not argv or argv[0].startswith("-")  # `sparsecompile --help`, or no subcommand: no torch import
    if top_level:
        build_parser(with_methods=False).parse_args(argv)
        return 2
    if not {"-h", "--help"} & set(argv):
        _first_pass(argv)
    parser = build_parser(with_methods=True)
    args = parser.parse_args(argv)
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args)
    except (ValueError, TypeError, OSError) as err:
        parser.exit(2, f"sparsecompile {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        parser.exit(130, "\nsparsecompile: interrupted\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
