"""Command line: ``sparsecompile generate | serve | warmup | export | bench``.

Every engine, serving and method flag is derived from the config dataclasses (``sparsecompile/config.py`` and
each method's config), with their help text and defaults, so a new option needs no CLI code. The top-level
``--help`` does not import torch; subcommands that list method flags import the method registry. Argument
errors that need no model are reported before torch is imported: a first pass parses the command line without
the method flags (``parse_known_args``) and checks the values; then the method and engine options are built
into their configs before the model loads. Every error is one line, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import (
    DTYPE_NAMES,
    EngineConfig,
    ServerConfig,
    ServingConfig,
    add_arguments,
    dtype_attribute,
    field_names,
    given,
    parse_bool,
)


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
    _add_engine(warm)
    if with_methods:
        _add_methods(warm)

    export = sub.add_parser("export", help="export a model and method as a compiled artifact directory (AOTInductor "
                                           "programs, weights, tokenizer, manifest) for `serve --artifact`")
    _add_model(export, methods)
    export.add_argument("--out", required=True, metavar="DIR", help="artifact directory to write")
    export.add_argument("--form", default=None, choices=["aoti", "exported"],
                        help="aoti: AOTInductor packages; exported: torch.export programs plus the decode step's "
                             "compile cache (default: aoti on CPU, exported on CUDA, where AOTI packages do not load "
                             "on the H200 image)")
    export.add_argument("--no-compile-cache", action="store_true",
                        help="with --form exported: ship no compile cache (the loader then runs the programs eagerly)")
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


def _options(args: argparse.Namespace, *configs: type) -> dict:
    """Engine / serving options given on the command line, plus every method option given."""
    options: dict = {}
    for config in configs:
        options.update(given(args, field_names(config)))
    options.update(given(args, getattr(args, "_method_options", []), dest_prefix="method_"))
    return options


def _torch_dtype(name: str):
    import torch

    attribute = dtype_attribute(name)
    return None if attribute is None else getattr(torch, attribute)


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .llm import LLM
    from .models.default_model import DEFAULT_MODEL_NAME
    from .server import serve
    from .server.app import API_KEY_ENV
    from .server.preprocess import load_chat_template

    server = ServerConfig(**given(args, field_names(ServerConfig)))
    load_chat_template(server.chat_template)  # a bad --chat-template fails now, not after loading the model
    model = args.model_path or args.model
    if args.artifact:
        return _serve_artifact(args, server, model)
    name = server.served_model_name or model or DEFAULT_MODEL_NAME
    server = replace(server, served_model_name=name)
    llm = LLM(model, args.method, device=args.device, dtype=_torch_dtype(args.dtype), model_name=name,
              **_options(args, EngineConfig, ServingConfig))
    if not llm.is_driver:  # a tensor-parallel worker rank under torchrun: it served rank 0 until rank 0 stopped
        return 0
    engine = llm.llm_engine
    keyed = " (API key required)" if (server.api_key or os.environ.get(API_KEY_ENV)) else ""
    print(f"sparsecompile: serving {name!r} (method {args.method}, max_model_len {engine.max_model_len}, "
          f"{engine.stats().total_pages} KV pages) on http://{server.host}:{server.port}/v1{keyed}", file=sys.stderr)
    try:
        serve(engine, server)
    except KeyboardInterrupt:  # uvicorn drains and shuts down on Ctrl-C, then re-raises it
        pass
    finally:
        llm.close()  # tensor-parallel workers stop with the server
    return 0


def _serve_artifact(args: argparse.Namespace, server, model: str | None) -> int:
    """``serve --artifact DIR``: the artifact's programs under the same server (options it fixes are refused)."""
    from dataclasses import replace

    from .export import load
    from .server import serve

    if model is not None:
        raise ValueError("pass --artifact or a model, not both (the artifact holds its model)")
    options = _options(args, EngineConfig, ServingConfig)
    if server.served_model_name:
        options["model_name"] = server.served_model_name
    engine = load(args.artifact, device=args.device, **options).llm_engine
    server = replace(server, served_model_name=engine.model_name)
    print(f"sparsecompile: serving {engine.model_name!r} (artifact {args.artifact}, method {engine.method}, "
          f"max_model_len {engine.max_model_len}, {engine.stats().total_pages} KV pages) on "
          f"http://{server.host}:{server.port}/v1", file=sys.stderr)
    try:
        serve(engine, server)
    except KeyboardInterrupt:
        pass
    return 0


def _export(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .export import export

    start = time.perf_counter()
    out = export(args.model, args.out, args.method, device=args.device, dtype=_torch_dtype(args.dtype), form=args.form,
                 compile_cache=not args.no_compile_cache, **_options(args, EngineConfig, ServingConfig))
    print(f"sparsecompile: exported {args.model or 'the embedded model'} with method {args.method} to {out} "
          f"({args.form or 'default form'}, {time.perf_counter() - start:.0f} s); serve it with "
          f"`sparsecompile serve --artifact {out}`",
          file=sys.stderr)
    return 0


_BENCH_SCRIPTS = {"--prefill": "prefill.py", "--user-path": "user_path.py"}  # default: decode.py


def _bench(argv: list[str]) -> int:
    import runpy
    from pathlib import Path

    rest = list(argv)
    name = next((_BENCH_SCRIPTS[a] for a in rest if a in _BENCH_SCRIPTS), "decode.py")
    rest = [a for a in rest if a not in _BENCH_SCRIPTS]
    script = Path(__file__).resolve().parent.parent / "benchmarks" / name
    if not script.exists():
        raise FileNotFoundError(f"sparsecompile bench runs {script}, which needs a source checkout of sparsecompile")
    if not {"-h", "--help"} & set(argv):
        import torch

        if not torch.cuda.is_available():
            print(f"sparsecompile bench: error: the {name} benchmark measures GPU time and needs a CUDA GPU; this "
                  f"machine has none (torch {torch.__version__})", file=sys.stderr)
            return 2
    sys.argv = [f"sparsecompile bench ({name})", *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _check_generate(args: argparse.Namespace) -> str:
    """Check what needs no torch and no model; return the prompt text. ``ValueError`` says what to change."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if args.prompt_file is not None:
        if os.path.isdir(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file!r} is a directory; pass a text file")
        if not os.path.exists(args.prompt_file):
            raise ValueError(f"--prompt-file {args.prompt_file!r} does not exist")
        try:
            with open(args.prompt_file, encoding="utf-8") as handle:
                text = handle.read()
        except UnicodeDecodeError:
            raise ValueError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text") from None
        if not text.strip():
            raise ValueError(f"--prompt-file {args.prompt_file!r} is empty")
        return text
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; pass the prompt text")
    return args.prompt


def _check_device(device: str | None) -> None:
    """``--device``: a CUDA device only where CUDA is available (checked before the model loads)."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}); "
                             "use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _generate(args: argparse.Namespace) -> int:
    text = _check_generate(args)
    _check_device(args.device)
    import torch

    import sparsecompile
    from sparsecompile.methods import make_config
    from sparsecompile.models.default_model import load_model
    from sparsecompile.optimize import split_method_options

    options = _options(args, EngineConfig)
    routed = split_method_options(args.method, options)  # every option checked before the model loads
    EngineConfig(**routed["engine"])
    make_config(args.method, routed["method"])
    model, tokenizer = load_model(args.model, dtype=_torch_dtype(args.dtype), device=args.device)
    sparsecompile.optimize(model, args.method, show_progress=True, **options)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
    ids = ids.to(model.device)
    sampling = {"do_sample": args.temperature > 0}
    if args.temperature > 0:
        sampling.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or None)
        torch.manual_seed(args.seed)
    streamer = None
    if not args.no_stream:
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, streamer=streamer,
                         **sampling)
    elapsed = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1]:]
    if streamer is None:
        print(tokenizer.decode(new, skip_special_tokens=True), flush=True)
    print(f"\n[{ids.shape[1]} prompt tokens, {new.numel()} generated in {elapsed:.2f} s, method {args.method}]",
          file=sys.stderr)
    cache = out["cache" if "cache" in out else "past_key_values"]
    print(sparsecompile.kv_stats(cache).summary(), file=sys.stderr)
    cache.release()
    return 0


def _warmup(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sparsecompile
    from sparsecompile.models.default_model import load_model

    model, _ = load_model(args.model, dtype=_torch_dtype(args.dtype), device=args.device)
    options = _options(args, EngineConfig)
    options.setdefault("compile", True)
    sparsecompile.optimize(model, args.method, **options)
    for batch, seconds in sparsecompile.warmup(model, args.batch_sizes, args.prompt_len, args.max_new_tokens).items():
        print(f"batch {batch}: {seconds:.1f} s", file=sys.stderr)
    return 0


def _first_pass(argv: list[str]) -> None:
    """Parse without the method flags (no torch import) and check what needs no model: instant errors."""
    light = build_parser(with_methods=False)
    args, _ = light.parse_known_args(argv)
    if args.command == "generate":
        try:
            _check_generate(args)
        except ValueError as err:
            light.exit(2, f"sparsecompile generate: error: {err}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    top_level = not argv or argv[0].startswith("-")  # `sparsecompile --help`, or no subcommand: no torch import
    if top_level:
        build_parser(with_methods=False).parse_args(argv)
        return 2
    if not {"-h", "--help"} & set(argv):
        _first_pass(argv)
    parser = build_parser(with_methods=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "warmup":
            return _warmup(args)
        if args.command == "export":
            return _export(args)
    except (ValueError, TypeError, OSError) as err:
        parser.exit(2, f"sparsecompile {args.command}: error: {err}\n")
    except KeyboardInterrupt:
        parser.exit(130, "\nsparsecompile: interrupted\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
