"""Host time of incremental detokenization a token (2026-12-05, twentieth session; CPU).

    python benchmarks/sessions/detokenizer_cost.py [--tokens 2000] [--repeats 5]

The serving detokenizer over the first ``tokens`` tokens of ``shared/reference/paper.txt`` (or the Austen text when
that is absent) with the embedded SmolLM2 tokenizer: through the tokenizer's own ``decode`` and through
:func:`~sparsecompile.serving.detokenizer.text_decoder`'s (the Rust decoder directly when equal). One JSON line a
path: the best of ``repeats`` runs, microseconds a token, and whether the text equals ``tokenizer.decode``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from sparsecompile.models.default_model import resolve_model_path
from sparsecompile.serving.detokenizer import Detokenizer, text_decoder
from sparsecompile.serving.outputs import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _text() -> str:
    paper = ROOT.parent / "shared" / "reference" / "paper.txt"
    if paper.exists():
        return paper.read_text(encoding="utf-8")
    sys.path.insert(0, str(ROOT / "tests"))
    from needle import AUSTEN_TEXT  # noqa: PLC0415 - the fallback text lives with the tests

    return Path(AUSTEN_TEXT).read_text(encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    ids = tokenizer.encode(_text()[: args.tokens * 8])[: args.tokens]
    params = SamplingParams(max_tokens=10**6)
    for name, decode in (("tokenizer.decode", None), ("text_decoder", text_decoder(tokenizer))):
        best, text = float("inf"), ""
        for _ in range(args.repeats):
            d = Detokenizer(tokenizer, params, set(), ids[:5], decode)
            start = time.perf_counter()
            for token in ids[5:]:
                d.append(token)
            best, text = min(best, time.perf_counter() - start), d.text
        print(json.dumps({"path": name, "us_per_token": round(best / (len(ids) - 5) * 1e6, 2), "tokens": len(ids) - 5,
                          "equals_decode": text == tokenizer.decode(ids[5:], skip_special_tokens=True),
                          "tokenizer": type(tokenizer).__name__}), flush=True)


if __name__ == "__main__":
    main()
