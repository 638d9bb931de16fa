"""The bodies of the ``sparsecompile`` subcommands (the parser and ``main`` are in :mod:`sparsecompile.cli`).

Importing this module is light (no torch): every heavy import is inside the command that needs it, so that the
CLI's first pass (:func:`check_generate`) and the top-level ``--help`` stay instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .cli_flags import given
from .config import EngineConfig, ServerConfig, ServingConfig, dtype_attribute, field_names


def given_options(args: argparse.Namespace, *configs: type) -> dict:
    """Engine / serving options given on the command line, plus every method option given."""
    options: dict = {}
    for config in configs:
        options.update(given(args, field_names(config)))
    options.update(given(args, getattr(args, "_method_options", []), dest_prefix="method_"))
    return options


def torch_dtype(name: str):
    import torch

    attribute = dtype_attribute(name)
    return None if attribute is None else getattr(torch, attribute)


def cmd_serve(args: argparse.Namespace) -> int:
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
    llm = LLM(model, args.method, device=args.device, dtype=torch_dtype(args.dtype), model_name=name,
              **given_options(args, EngineConfig, ServingConfig))
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
    options = given_options(args, EngineConfig, ServingConfig)
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


def cmd_export(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .export import export

    start = time.perf_counter()
    out = export(args.model, args.out, args.method, device=args.device, dtype=torch_dtype(args.dtype), form=args.form,
                 compile_cache=not args.no_compile_cache, kernels=not args.no_kernels,
                 **given_options(args, EngineConfig, ServingConfig))
    print(f"sparsecompile: exported {args.model or 'the embedded model'} with method {args.method} to {out} "
          f"({args.form} form, {time.perf_counter() - start:.0f} s); serve it with "
          f"`sparsecompile serve --artifact {out}`",
          file=sys.stderr)
    return 0


_BENCH_SCRIPTS = {"--prefill": "prefill.py", "--user-path": "user_path.py"}  # default: decode.py


def cmd_bench(argv: list[str]) -> int:
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


def check_generate(args: argparse.Namespace) -> str:
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


def check_device(device: str | None) -> None:
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


def cmd_generate(args: argparse.Namespace) -> int:
    text = check_generate(args)
    check_device(args.device)
    import torch

    import sparsecompile
    from sparsecompile.methods import make_config
    from sparsecompile.models.default_model import load_model
    from sparsecompile.optimize import split_method_options

    options = given_options(args, EngineConfig)
    routed = split_method_options(args.method, options)  # every option checked before the model loads
    EngineConfig(**routed["engine"])
    make_config(args.method, routed["method"])
    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
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


def cmd_warmup(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import sparsecompile
    from sparsecompile.models.default_model import load_model

    model, _ = load_model(args.model, dtype=torch_dtype(args.dtype), device=args.device)
    options = given_options(args, EngineConfig)
    options.setdefault("compile", True)
    sparsecompile.optimize(model, args.method, **options)
    for batch, seconds in sparsecompile.warmup(model, args.batch_sizes, args.prompt_len, args.max_new_tokens,
                                               programs=args.programs).items():
        print(f"batch {batch}: {seconds:.1f} s", file=sys.stderr)
    return 0


#: subcommand name -> its body (``bench`` is run by ``main`` before any parsing: it forwards its arguments).
COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "warmup": cmd_warmup, "export": cmd_export}
