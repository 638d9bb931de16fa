"""KVzip on the embedded SmolLM2-135M: the passkey depth matrix and the extra prefill cost (CPU or GPU).

    python benchmarks/kvzip_passkey.py [--depths 0.2,0.5,0.8] [--tokens 3000] [--ratio 0.3] [--out FILE]

For each depth of the passkey in a ~``--tokens`` Austen haystack (tests/needle.py), greedy answers of the
unpatched model, SnapKV and KVzip (global and uniform selection) at ``--ratio``, and whether each retrieves the
passkey; then the prefill time (``model(ids, logits_to_keep=1)``, best of two) of vanilla, SnapKV and KVzip, whose
ratio is KVzip's extra cost (its re-read of the prompt). JSON lines to ``--out``; a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from needle import passkey_prompt  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile.methods.kvzip import CONTINUE_TEXT, REPEAT_TEXT  # noqa: E402
from sparsecompile.models.default_model import load_model  # noqa: E402

PASSKEY = "68213"


def systems(tokenizer, ratio: float) -> dict[str, tuple[str, dict]]:
    lead = {name: tokenizer.encode(text, add_special_tokens=False)
            for name, text in (("repeat_ids", REPEAT_TEXT), ("continue_ids", CONTINUE_TEXT))}
    return {"vanilla": ("vanilla", {}), "snapkv": ("snapkv", {"ratio": ratio}),
            "kvzip_global": ("kvzip", {"ratio": ratio, "selection": "global", **lead}),
            "kvzip_uniform": ("kvzip", {"ratio": ratio, "selection": "uniform", **lead})}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="0.2,0.5,0.8")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--ratio", type=float, default=0.3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_model(None, dtype=dtype, device=args.device)
    rows = []
    table = systems(tokenizer, args.ratio)
    for depth in [float(d) for d in args.depths.split(",")]:
        ids = passkey_prompt(tokenizer, PASSKEY, target_tokens=args.tokens, depth=depth, source="austen")
        ids = ids.to(args.device)
        for name, (method, options) in table.items():
            patched = sparsecompile.optimize(copy.deepcopy(model), method, **options)
            out = patched.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   do_sample=False)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            rows.append({"kind": "passkey", "depth": depth, "tokens": ids.shape[1], "system": name,
                         "ratio": args.ratio, "retrieved": PASSKEY in re.sub(r"\D", "", text), "answer": text})
            print(json.dumps(rows[-1]), flush=True)
    ids = passkey_prompt(tokenizer, PASSKEY, target_tokens=args.tokens, depth=0.5, source="austen").to(args.device)
    for name in ("vanilla", "snapkv", "kvzip_global"):
        method, options = table[name]
        patched = sparsecompile.optimize(copy.deepcopy(model), method, **options)
        best = float("inf")
        for _ in range(2):
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = patched(input_ids=ids, logits_to_keep=1)
            if args.device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
            (out["cache"] if "cache" in out else out["past_key_values"]).release()
        rows.append({"kind": "prefill", "system": name, "tokens": ids.shape[1], "device": args.device,
                     "seconds": round(best, 3)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    base = next(r["seconds"] for r in rows if r["kind"] == "prefill" and r["system"] == "vanilla")
    print(f"\n{'depth':>6} " + " ".join(f"{n:>14}" for n in table))
    for depth in sorted({r["depth"] for r in rows if r["kind"] == "passkey"}):
        found = {r["system"]: r["retrieved"] for r in rows if r["kind"] == "passkey" and r["depth"] == depth}
        print(f"{depth:>6} " + " ".join(f"{str(found[n]):>14}" for n in table))
    for r in rows:
        if r["kind"] == "prefill":
            print(f"prefill {r['system']:>13}: {r['seconds']:.2f} s ({r['seconds'] / base:.2f}x vanilla)")


if __name__ == "__main__":
    main()
