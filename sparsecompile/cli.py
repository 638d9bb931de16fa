"""Command line: ``sparsecompile generate --model PATH --method M [method options] --prompt TEXT``,
``sparsecompile serve --model PATH --method M [options]`` (OpenAI-compatible HTTP server)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing

from .methods import available_methods, method_class


def _method_option_types() -> dict[str, type]:
    """Every option of every registered method, with the type its default has."""
    options: dict[str, type] = {}
    for name in available_methods():
        config = method_class(name).config_class
        hints = typing.get_type_hints(config)
        for field in dataclasses.fields(config):
            hint = hints.get(field.name, str)
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            options.setdefault(field.name, args[0] if args[0] in (int, float, str, bool) else str)
    return options


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsecompile", description="sparse-first LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text with a sparse method and print a KV-memory summary")
    gen.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    gen.add_argument("--method", default="vanilla", choices=available_methods())
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-file", help="file holding the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    engine = gen.add_argument_group("engine options")
    engine.add_argument("--page-size", type=int, default=16)
    engine.add_argument("--prefill-chunk-size", type=int, default=2048)
    engine.add_argument("--compile", type=_parse_bool, default=None, help="compile decode steps (default: on CUDA)")
    _add_method_options(gen)
    _add_serve_parser(sub)
    bench = sub.add_parser("bench", help="decode benchmark against the HBM roofline (runs benchmarks/decode.py; "
                                         "CUDA only; pass its options after 'bench', e.g. --grid quick)",
                           add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)  # parsed by benchmarks/decode.py itself
    return parser


def _add_method_options(parser: argparse.ArgumentParser) -> None:
    method = parser.add_argument_group("method options (each applies to the methods that define it)")
    for name, kind in sorted(_method_option_types().items()):
        method.add_argument(f"--{name.replace('_', '-')}", dest=f"method_{name}", default=None,
                            type=_parse_bool if kind is bool else kind)


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


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API "
                                         "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics)")
    serve.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded "
                                                     "SmolLM2-135M)")
    serve.add_argument("--method", default="vanilla", choices=available_methods())
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="model id clients send and /v1/models lists (default: --model as given, or the "
                            "embedded model's name)")
    serve.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    serve.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    engine = serve.add_argument_group("engine options")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step, decode tokens plus prompt chunks (default: the prefill chunk)")
    engine.add_argument("--kv-cache-memory", type=_parse_memory, default=None,
                        help="KV pool: bytes (4GiB, 512MiB) or a fraction of free GPU memory (default: 0.85 on "
                             "CUDA, 1 GiB on CPU)")
    engine.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output "
                                                                        "(default: the model's)")
    engine.add_argument("--page-size", type=int, default=16)
    engine.add_argument("--prefill-chunk-size", type=int, default=2048)
    engine.add_argument("--compile", type=_parse_bool, default=None, help="compile decode steps (default: on CUDA)")
    _add_method_options(serve)


def _serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from sparsecompile.llm import LLM
    from sparsecompile.models.default_model import DEFAULT_MODEL_NAME
    from sparsecompile.server import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    options = {k[len("method_"):]: v for k, v in vars(args).items() if k.startswith("method_") and v is not None}
    options.update(page_size=args.page_size, prefill_chunk_size=args.prefill_chunk_size)
    if args.compile is not None:
        options["compile"] = args.compile
    name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    llm = LLM(args.model, args.method, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, model_name=name, **options)
    engine = llm.llm_engine
    print(f"sparsecompile: serving {name!r} (method {args.method}, max_model_len {engine.max_model_len}, "
          f"{engine.stats().total_pages} KV pages) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        serve(engine, host=args.host, port=args.port, served_model_name=name, log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then re-raises it
        pass
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
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer = load_model(args.model, dtype=dtype, device=args.device)
    options = {k[len("method_"):]: v for k, v in vars(args).items() if k.startswith("method_") and v is not None}
    engine = {"page_size": args.page_size, "prefill_chunk_size": args.prefill_chunk_size, "show_progress": True}
    if args.compile is not None:
        engine["compile"] = args.compile
    sparsecompile.optimize(model, args.method, **engine, **options)
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
    print(sparsecompile.kv_stats(out[_cache_key(out)]).summary(), file=sys.stderr)
    out[_cache_key(out)].release()
    return 0


def _cache_key(out) -> str:
    return "cache" if "cache" in out else "past_key_values"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        return _bench(argparse.Namespace(args=argv[1:]))
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "serve":
            return _serve(args)
    except (ValueError, FileNotFoundError, TypeError) as err:
        parser.exit(2, f"sparsecompile: error: {err}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
