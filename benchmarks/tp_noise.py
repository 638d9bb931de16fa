"""The bf16 noise floor of ``tp.py``'s equality check: the same comparison (``tp.compare``) between single-GPU runs
that differ only in how floating-point sums are ordered, so that TP N's figures can be read against it.

    python benchmarks/tp_noise.py --reference DIR/tp_reference.pt --out DIR    # one GPU, ~2 min

TP 1's saved vanilla reference (``sparsecompile`` vanilla, eager decode) is compared with the unpatched HF model,
SDPA and eager attention, teacher-forced on TP 1's tokens: the same random Llama-3.1-8B-shape model (seed 0), the
same prompts. A dense model computed two legal ways differs by this much; TP 2 adds one more reordering (the
all-reduce of each attention block's and MLP's partial sums).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402
from tp import compare  # noqa: E402


def hf_greedy_and_forced(model, ids: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpatched model's greedy tokens ``[batch, steps]`` and its logits ``[batch, steps, vocab]`` when TP 1's
    ``tokens`` are fed back one step at a time (bf16, CPU)."""
    steps = tokens.shape[1]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, pad_token_id=0)
    greedy = out[:, ids.shape[1]:].cpu()
    step = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, logits = step.past_key_values, [step.logits[:, -1]]
    for k in range(steps - 1):
        step = model(input_ids=tokens[:, k:k + 1], past_key_values=cache, use_cache=True)
        logits.append(step.logits[:, -1])
    return greedy, torch.stack(logits, 1).to(torch.bfloat16).cpu()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="TP 1's tp_reference.pt (tp.py's equality part)")
    parser.add_argument("--prompt", type=int, default=6144, help="as tp.py's --prompt of the reference run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    want = torch.load(args.reference)["vanilla"]
    model = decode.build_model()
    ids = torch.randint(3, 1000, (2, args.prompt), generator=torch.Generator().manual_seed(0)).cuda()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tp_noise.jsonl"), "w") as handle:
        for attention in ("sdpa", "eager"):
            model.set_attn_implementation(attention)
            with torch.no_grad():
                tokens, logits = hf_greedy_and_forced(model, ids, want["tokens"].cuda())
            row = {"part": "noise_floor", "reference": "sparsecompile vanilla TP 1", "candidate": f"hf {attention}",
                   **compare(tokens, logits, want["tokens"], want)}
            handle.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
