"""h2o+kivi (or quest+kivi) on the embedded SmolLM2-135M (CPU or GPU): the passkey at three depths against the policy
alone, and the KV each holds and reads (``kv_stats``).

    python benchmarks/sessions/h2o_kivi_passkey.py [--budget 1536] [--new 40] [--out FILE]
    python benchmarks/sessions/h2o_kivi_passkey.py --family quest --budget 512 --new 12 [--out FILE]

H2O answers the ~3K-token passkey at budget 1536 with 128 recent tokens (tests/test_passkey_smollm2.py); ``--new``
40 tokens take each row past ``budget + 32``, so one key group per KV head leaves during the answer. ``--family
quest``: Quest and Quest over KIVI pages selecting at every length (``dense_below=0``; Quest's first two layers
dense). JSON lines to ``--out``; a table last.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from needle import passkey_prompt  # noqa: E402

import sparsecompile  # noqa: E402
from sparsecompile.models.default_model import load_model  # noqa: E402

PASSKEY = "68213"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="0.2,0.5,0.8")
    parser.add_argument("--budget", type=int, default=1536)
    parser.add_argument("--recent", type=int, default=128)
    parser.add_argument("--new", type=int, default=40)
    parser.add_argument("--family", choices=("h2o", "quest"), default="h2o")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(None, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                                  device=args.device)
    f = args.family
    systems = {f: (f, {}), f"{f}+kivi4": (f"{f}+kivi", {"bits": 4}), f"{f}+kivi2": (f"{f}+kivi", {"bits": 2})}
    common = dict(recent=args.recent) if f == "h2o" else dict(dense_below=0)
    rows = []
    for depth in [float(d) for d in args.depths.split(",")]:
        ids = passkey_prompt(tokenizer, PASSKEY, target_tokens=3000, depth=depth, source="austen").to(args.device)
        for name, (method, options) in systems.items():
            patched = sparsecompile.optimize(copy.deepcopy(model), method, budget=args.budget, **common, **options)
            out = patched.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                                   min_new_tokens=args.new, do_sample=False, return_dict_in_generate=True)
            text = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
            cache = out["cache"] if "cache" in out else out["past_key_values"]
            stats = sparsecompile.kv_stats(cache)
            read = [layer.tokens_read for layer in stats.layers]
            rows.append({"depth": depth, "tokens": ids.shape[1], "system": name, "budget": args.budget, **common,
                         "tokens_read": None if None in read else sum(read),
                         "new_tokens": args.new, "retrieved": PASSKEY in re.sub(r"\D", "", text[:60]),
                         "answer": text[:60], "resident_MB": stats.resident_bytes / 1e6,
                         "resident_tokens": stats.resident_tokens})
            cache.release()
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n{'depth':>6} " + " ".join(f"{n:>18}" for n in systems))
    for depth in sorted({r["depth"] for r in rows}):
        cells = {r["system"]: f"{r['retrieved']} {r['resident_MB']:.1f} MB" for r in rows if r["depth"] == depth}
        print(f"{depth:>6} " + " ".join(f"{cells[n]:>18}" for n in systems))


if __name__ == "__main__":
    main()
