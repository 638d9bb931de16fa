"""Session helper (#20, 2026-12-04 fourteenth session): from kivi_gluon_sweep.py's JSON lines, each variant's time
summed over the points relative to the fastest at each point; the best per bit width to a JSON file that the
kivi_chains stage tests with.

    python benchmarks/sessions/kivi_gluon_pick.py SWEEP.jsonl BEST.json
"""

from __future__ import annotations

import collections
import json
import sys


def main(sweep: str, out: str) -> None:
    rows = [json.loads(line) for line in open(sweep)]
    fastest = collections.defaultdict(lambda: float("inf"))
    for r in rows:
        point = (r["bits"], r["batch"], r["context"])
        fastest[point] = min(fastest[point], r["us"])
    total = collections.defaultdict(float)
    for r in rows:
        total[(r["bits"], r["stages"], r["programs_per_sm"], r.get("qk_chains", 1))] += \
            r["us"] / fastest[(r["bits"], r["batch"], r["context"])]
    best = {}
    for (bits, stages, per_sm, chains), t in sorted(total.items(), key=lambda kv: kv[1]):
        print(bits, stages, per_sm, chains, round(t, 3))
        best.setdefault(bits, {"stages": stages, "programs_per_sm": per_sm, "qk_chains": chains})
    json.dump({str(k): v for k, v in best.items()}, open(out, "w"))
    print(best)


if __name__ == "__main__":
    main(*sys.argv[1:3])
