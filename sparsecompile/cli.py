"""Command line: ``sparsecompile generate | serve | bench``.

Every engine, serving and method flag is derived from the config dataclasses (``sparsecompile/config.py`` and
each method's config), with their help text and defaults, so a new option needs no CLI code. The top-level
``--help`` does not import torch; subcommands that list method flags import the method registry.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .config import EngineConfig, ServingConfig, add_arguments, given, parse_bool

_DTYPES = ("auto", "float32", "bfloat16", "float16", "half")


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


_ENGINE_TYPES = {"compile": _auto_or_bool, "cuda_graphs": _auto_or_bool}


def _add_engine(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine options (sparsecompile.config.EngineConfig)")
    add_arguments(engine, EngineConfig, skip=("show_progress",), types=_ENGINE_TYPES)


def _add_methods(parser: argparse.ArgumentParser) -> None:
    """One flag per option of any registered method (methods share names such as --budget: the first wins)."""
    from .methods import available_methods, method_class

    group = parser.add_argument_group("method options (each applies to the methods that declare it)")
    seen: set[str] = set()
    for name in available_methods():
        add_arguments(group, method_class(name).config_class, dest_prefix="method_", seen=seen)
    parser.set_defaults(_method_options=sorted(seen))


def _add_model(parser: argparse.ArgumentParser, methods: list[str] | None) -> None:
    parser.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded "
                                                      "SmolLM2-135M-Instruct)")
    parser.add_argument("--method", default="vanilla", choices=methods,
                        help="sparse method (default: vanilla)" + ("" if methods else "; see a subcommand's --help"))
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=_DTYPES,
                        help="weights and KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")


def build_parser(with_methods: bool = True) -> argparse.ArgumentParser:
    """The CLI parser; ``with_methods=False`` leaves out method flags (no torch import: instant top-level help)."""
    methods = None
    if with_methods:
        from .methods import available_methods

        methods = available_methods()
    parser = argparse.ArgumentParser(prog="sparsecompile", description="sparse-first LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with a sparse method and print a KV-memory summary")
    _add_model(gen, methods)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: 1, off)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    _add_engine(gen)
    if with_methods:
        _add_methods(gen)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API "
                                         "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="HF model directory or .gguf file (same as --model)")
    _add_model(serve, methods)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: the model as given, or the "
                            "embedded model's name)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level (default: info)")
    serving = serve.add_argument_group("serving options (sparsecompile.config.ServingConfig)")
    add_arguments(serving, ServingConfig, skip=("model_name",), types={"kv_cache_memory": _parse_memory})
    _add_engine(serve)
    if with_methods:
        _add_methods(serve)

    bench = sub.add_parser("bench", help="decode benchmark against the HBM roofline (runs benchmarks/decode.py; "
                                         "CUDA only; pass its options after 'bench', e.g. --grid quick)",
                           add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)  # parsed by benchmarks/decode.py itself
    return parser


def _options(args: argparse.Namespace, *configs: type) -> dict:
    """Engine / serving options given on the command line, plus every method option given."""
    from .config import field_names

    options: dict = {}
    for config in configs:
        options.update(given(args, field_names(config)))
    options.update(given(args, getattr(args, "_method_options", []), dest_prefix="method_"))
    return options


def _torch_dtype(name: str):
    import torch

    return None if name == "auto" else getattr(torch, "float16" if name == "half" else name)


def _serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .llm import LLM
    from .models.default_model import DEFAULT_MODEL_NAME
    from .server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    model = args.model_path or args.model
    name = args.served_model_name or model or DEFAULT_MODEL_NAME
    llm = LLM(model, args.method, device=args.device, dtype=_torch_dtype(args.dtype), model_name=name,
              **_options(args, EngineConfig, ServingConfig))
    if not llm.is_driver:  # a tensor-parallel worker rank under torchrun: it served rank 0 until rank 0 stopped
        return 0
    engine = llm.llm_engine
    print(f"sparsecompile: serving {name!r} (method {args.method}, max_model_len {engine.max_model_len}, "
          f"{engine.stats().total_pages} KV pages) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        serve(engine, host=args.host, port=args.port, served_model_name=name, log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then re-raises it
        pass
    finally:
        llm.close()  # tensor-parallel workers stop with the server
    return 0


def _bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "decode.py"
    if not script.exists():
        raise FileNotFoundError(f"sparsecompile bench runs {script}, which needs a source checkout of sparsecompile")
    sys.argv = [str(script), *args.args]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _generate(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import sparsecompile
    from sparsecompile.models.default_model import load_model

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as handle:
            text = handle.read()
    else:
        text = args.prompt
    model, tokenizer = load_model(args.model, dtype=_torch_dtype(args.dtype), device=args.device)
    sparsecompile.optimize(model, args.method, show_progress=True, **_options(args, EngineConfig))
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
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id, **sampling)
    elapsed = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1]:]
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(f"\n[{ids.shape[1]} prompt tokens, {new.numel()} generated in {elapsed:.2f} s, method {args.method}]",
          file=sys.stderr)
    cache = out["cache" if "cache" in out else "past_key_values"]
    print(sparsecompile.kv_stats(cache).summary(), file=sys.stderr)
    cache.release()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argparse.Namespace(args=argv[1:]))
    top_level = not argv or argv[0].startswith("-")  # `sparsecompile --help`, or no subcommand: no torch import
    parser = build_parser(with_methods=not top_level)
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "serve":
            return _serve(args)
    except (ValueError, FileNotFoundError, TypeError) as err:
        parser.exit(2, f"sparsecompile: error: {err}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
