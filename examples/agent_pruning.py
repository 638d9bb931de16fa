"""An agent loop that prunes old tool results: multi-turn serving with a chain per conversation and interval pruning.

    python examples/agent_pruning.py [--rounds 8] [--lag 4] [--keep 0.2] [--method snapkv] [--model PATH]

Each round a "tool" returns a result (paragraphs of the Python reference that the standard library ships) and the
model answers; the conversation's KV stays idle between rounds under its ``chain_id``, so each round prefills only
the new tokens. When a new tool result arrives, the result from ``--lag`` rounds ago has served its purpose: its
KV entries are pruned to ``--keep`` of its tokens (KVzip scoring: what the model needs to reconstruct it), inside
page boundaries. The token history is untouched, so the next round still continues the chain; attention then
reads the compressed history (the request's ``metrics.compressed_history``).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a model hub

from sparsecompile import LLM, SamplingParams  # noqa: E402


def tool_results(count: int, paragraphs: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k].strip() for k in sorted(topics) if len(topics[k]) > 400]
    return ["\n\n".join(texts[i * paragraphs:(i + 1) * paragraphs])[:2500] for i in range(count)]


def segment(tokenizer, text: str) -> list[int]:
    """A user message (the tool result) and the opened assistant turn, in ChatML when the tokenizer knows it."""
    chatml = "<|im_start|>" in tokenizer.get_vocab()
    rendered = (f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" if chatml
                else f"\n\nUser: {text}\nAssistant:")
    return tokenizer(rendered, add_special_tokens=False).input_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--method", default="snapkv", help="an eviction method (pruning needs one)")
    parser.add_argument("--budget", type=int, default=65536, help="the method's own budget (large: prune only)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--lag", type=int, default=4, help="prune the tool result from this many rounds ago")
    parser.add_argument("--keep", type=float, default=0.2, help="fraction of a pruned result's tokens kept")
    args = parser.parse_args()

    llm = LLM(args.model, args.method, budget=args.budget, page_size=16, max_model_len=32768)
    tok, engine, page = llm.tokenizer, llm.llm_engine, 16
    params = SamplingParams(temperature=0, max_tokens=24)
    history = tok.apply_chat_template([{"role": "system", "content": "You read tool results and summarise each "
                                        "in one sentence."}], tokenize=False)
    history = tok(history, add_special_tokens=False).input_ids
    spans: list[tuple[int, int]] = []
    for round_, result in enumerate(tool_results(args.rounds, 3)):
        if round_ >= args.lag:  # a new result arrived: compress the one from `lag` rounds ago
            start, end = spans[round_ - args.lag]
            lo, hi = -(-start // page) * page, end // page * page  # whole pages inside the result
            pruned = llm.prune("agent", [(lo, hi)], keep_tokens=int(args.keep * (hi - lo)), policy="kvzip")
            print(f"  pruned result {round_ - args.lag} [{lo}, {hi}) to {int(args.keep * (hi - lo))} tokens per "
                  f"head: {pruned.removed_entries} entries, {pruned.freed_pages} pages freed in "
                  f"{pruned.seconds:.2f} s")
        new = segment(tok, f"Tool result {round_}:\n{result}")
        spans.append((len(history), len(history) + len(new)))
        history = history + new
        out = llm.generate([history], params, use_tqdm=False, chain_ids=["agent"])[0]
        history = history + out.outputs[0].token_ids
        stats = engine.stats()
        m = out.metrics
        print(f"round {round_}: {len(history)} tokens of history, {m.num_cached_tokens} reused "
              f"({'compressed history' if m.compressed_history else 'full history'}), "
              f"{stats.total_pages - stats.free_pages} KV pages held -> {out.outputs[0].text.strip()[:70]!r}")
    engine.drop_chain("agent")


if __name__ == "__main__":
    main()
