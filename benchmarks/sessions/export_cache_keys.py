"""Session diagnostic (2026-12-05, twenty-second session): why the fallback form's load missed inductor's cache on
the H200 (``tests/gpu/test_export_cuda.py::test_the_exported_form_serves_without_aoti``: ``fxgraph_cache_miss`` 3,
no hit, ``results/gpu_tests_export_22nd_h200.log``; it passed on 2026-12-02; on the CPU both a fresh loading process
and a load in the exporting process hit).

It exports that test's artifact (the 8B shape cut to 2 layers, fp32, ``snapkv``) with a ``sitecustomize`` on the
path that logs every FX-graph cache key inductor computes (the key and its components, ``compiled_fx_graph_hash``)
and every lookup's outcome (hit, full miss, or a guard miss with the guard expression), in the export's own child
(the one that compiles the shipped cache with a 1 GiB pool) and in three loads: a fresh process with the default KV
memory (most of the GPU), a fresh process with the child's 1 GiB, and this process. Prints each load's counters,
then each load's key components that differ from the child's for the same bucket; a guard miss prints the guard
that failed.

    python benchmarks/sessions/export_cache_keys.py --out DIR   # DIR/cache_keys.jsonl, the summary on stdout
    python benchmarks/sessions/export_cache_keys.py --out DIR --tiny   # the CPU check of the hooks (tiny Llama)
    python benchmarks/sessions/export_cache_keys.py --out DIR --tiny --before aoti   # the cause, on the CPU
    python benchmarks/sessions/export_cache_keys.py --out DIR --tiny --tiny-device cuda --before aoti --no-fresh
        # the fix on a GPU (not run yet: no device time was left)

Found (2026-12-05, twenty-third session). On an H100 every load hit, alone and after an eager engine in the same
process (``results/export_keys_{alone,after_eager}_h100.log``; the failing test alone passed there too). In the
failing run the test's worker had first exported an AOTI artifact in-process, and ``--tiny --before aoti`` reproduces
the miss on the CPU: the in-process load's AOTAutograd and FX keys differ from the child's in one component,
``inductor_config[aot_inductor.metadata]``, which AOTInductor fills in place with the package's device facts
(``AOTI_DEVICE_KEY``, platform, ISA). ``compile_package`` now compiles with a copy of that dict; with it the same run
gives the child's key.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu"), str(ROOT / "benchmarks")]

_HOOK = r'''
import json, os
_LOG = os.environ.get("SC_KEYLOG")
if _LOG:
    import torch._inductor.codecache as _cc

    def _write(record):
        with open(_LOG, "a") as f:
            f.write(json.dumps({"tag": os.environ.get("SC_KEYTAG", "?"), "pid": os.getpid(), **record}) + "\n")

    _hash = _cc.compiled_fx_graph_hash

    def _logged_hash(*args, **kwargs):
        key, lines = _hash(*args, **kwargs)
        _write({"event": "key", "key": key, "lines": [str(x) for x in lines]})
        return key, lines

    _find = _cc.FxGraphCache.find_guarded_entry.__func__

    def _logged_find(cls, key, *args, **kwargs):
        graph, content, info = _find(cls, key, *args, **kwargs)
        _write({"event": "lookup", "key": key, **{k: str(v) for k, v in info.items()}})
        return graph, content, info

    _cc.compiled_fx_graph_hash = _logged_hash
    _cc.FxGraphCache.find_guarded_entry = classmethod(_logged_find)

    import torch._functorch._aot_autograd.autograd_cache as _ac

    _aot_key = _ac.autograd_cache_key

    def _logged_aot_key(*args, **kwargs):
        key, lines = _aot_key(*args, **kwargs)
        _write({"event": "aot_key", "key": key, "lines": [str(x) for x in lines]})
        return key, lines

    _ac.autograd_cache_key = _logged_aot_key
'''

_FRESH = r"""
import json, sys
import sparsecompile
from torch._dynamo.utils import counters
kv = int(sys.argv[2])
llm = sparsecompile.load(sys.argv[1], **({"kv_cache_memory": kv} if kv else {}))
print("COUNTERS " + json.dumps({k: dict(counters[k]) for k in ("aot_autograd", "inductor")}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU (checks the hooks)")
    parser.add_argument("--tiny-device", default="cpu", help="--tiny's device (cuda: the fix checked on a GPU)")
    parser.add_argument("--no-fresh", action="store_true", help="only the in-process load (no fresh processes)")
    parser.add_argument("--before", choices=("none", "eager", "aoti"), default="none",
                        help="what this process does first, as the fresh-process export test did in the failing "
                             "test's worker: eager, serve the model with an eager pyramidkv LLM and restore it; aoti, "
                             "export a pyramidkv AOTI artifact (with an empty package cache, so it compiles)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "cache_keys.jsonl"
    log.unlink(missing_ok=True)
    hook_dir = Path(tempfile.mkdtemp(prefix="sc-hook-"))
    (hook_dir / "sitecustomize.py").write_text(_HOOK)
    os.environ.update(SC_KEYLOG=str(log), SC_KEYTAG="child",
                      PYTHONPATH=os.pathsep.join([str(hook_dir), str(ROOT), os.environ.get("PYTHONPATH", "")]))

    from tiny_models import tiny_pair, word_tokenizer

    import sparsecompile

    if args.tiny:
        model, vocab = tiny_pair("llama")[1].to(args.tiny_device), 96
        options = dict(max_num_seqs=1, max_model_len=64, page_size=4, prefill_chunk_size=16, budget=12, window=4)
    else:
        from test_export_cuda import ENGINE, METHODS, _model

        model, vocab, options = _model(), 128256, {**ENGINE, **METHODS["snapkv"]}
    if args.before == "eager":
        from test_export_cuda import METHODS as TEST_METHODS
        from test_export_cuda import _prompts

        eager = sparsecompile.LLM(model, "pyramidkv", tokenizer=word_tokenizer(vocab), compile=False,
                                  **{**options, **TEST_METHODS["pyramidkv"]})
        eager.generate(_prompts() if not args.tiny else [[5, 6, 7, 8] * 5],
                       sparsecompile.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        sparsecompile.restore(model)
        del eager
    work = Path(tempfile.mkdtemp(prefix="sc-keys-"))
    if args.before == "aoti":
        from test_export_cuda import METHODS as TEST_METHODS

        os.environ["SPARSECOMPILE_CACHE"] = str(work / "packages")
        extra = {"budget": 12, "window": 4} if args.tiny else TEST_METHODS["pyramidkv"]
        sparsecompile.export(model, work / "aoti", "pyramidkv", tokenizer=word_tokenizer(vocab), form="aoti",
                             **{**options, **extra})
    path = sparsecompile.export(model, work / "exported", "snapkv", tokenizer=word_tokenizer(vocab), form="exported",
                                **options)
    for tag, kv in () if args.no_fresh else (("fresh_default", 0), ("fresh_1g", 1 << 30)):
        cold = {name: str(work / tag / name) for name in ("SPARSECOMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                                                           "TRITON_CACHE_DIR")}
        done = subprocess.run([sys.executable, "-c", _FRESH, str(path), str(kv)], capture_output=True, text=True,
                              env={**os.environ, **cold, "SC_KEYTAG": tag}, timeout=900)
        found = [ln[9:] for ln in done.stdout.splitlines() if ln.startswith("COUNTERS ")]
        print(tag, "rc", done.returncode, found[0] if found else done.stderr[-2000:], flush=True)
    os.environ["SC_KEYTAG"] = "in_process"
    exec(compile(_HOOK, "hook", "exec"), {})
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    sparsecompile.load(path)
    print("in_process", json.dumps({k: dict(counters[k]) for k in ("aot_autograd", "inductor")}), flush=True)
    _summarize(log)


def _summarize(log: Path) -> None:
    """Each load's lookups, and its key components that differ from the child's key of the same order."""
    records = [json.loads(ln) for ln in log.read_text().splitlines()]
    keys: dict[str, list[dict]] = {}
    for r in records:
        if r["event"] in ("key", "aot_key"):
            keys.setdefault(f"{r['tag']}/{r['event']}", []).append(r)
        else:
            print("lookup", r["tag"], r["key"][:16], r.get("cache_status_detailed"),
                  r.get("cache_status_guard_expr", ""))
    print("keys computed:", {tag: len(found) for tag, found in keys.items()})
    for tag, found in keys.items():
        who, event = tag.split("/")
        base = keys.get(f"child/{event}", [])
        if who == "child":
            continue
        for i, r in enumerate(found):
            if i >= len(base):
                print(tag, i, "no child key of that order")
                continue
            ours, theirs = set(r["lines"]), set(base[i]["lines"])
            print(tag, i, "same key" if r["key"] == base[i]["key"] else "key differs")
            for line in sorted(ours - theirs)[:12]:
                print("   +", line[:400])
            for line in sorted(theirs - ours)[:12]:
                print("   -", line[:400])


if __name__ == "__main__":
    main()
