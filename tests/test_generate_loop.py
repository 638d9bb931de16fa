"""generate()'s own decoding loop (models/fast_generate.py) gives what transformers' loop gives, option by option."""

from __future__ import annotations

import pytest
import torch
from tiny_models import left_padded_batch, tiny_pair
from transformers.generation.streamers import BaseStreamer

import sparsecompile
from sparsecompile.models.hf_patch import patched_model


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended = True


def _eos_after_three(reference, ids, mask) -> int:
    """A token the unpatched model emits a few steps in, so EOS stops one row early."""
    out = reference.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=0)
    return int(out[0, -1])


OPTIONS = {
    "greedy": dict(do_sample=False),
    "sample": dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9),
    "penalties": dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2),
    "min_new_tokens": dict(do_sample=False, min_new_tokens=6),
    "scores": dict(do_sample=True, return_dict_in_generate=True, output_scores=True, output_logits=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_loop_equals_transformers_for_each_option(name):
    reference, model = tiny_pair()
    sparsecompile.optimize(model, "vanilla")
    ids, mask = left_padded_batch((11, 7, 4))
    eos = _eos_after_three(reference, ids, mask)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=eos, **OPTIONS[name])
    torch.manual_seed(3)
    want = reference.generate(ids, **kwargs)
    torch.manual_seed(3)
    got = model.generate(ids, **kwargs)
    if kwargs.get("return_dict_in_generate"):
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores, strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(got.logits, want.logits, strict=True):
            torch.testing.assert_close(a, b)
    else:
        assert torch.equal(got, want)


def test_streamer_sees_what_transformers_streams_and_eos_stops_exactly():
    reference, model = tiny_pair()
    sparsecompile.optimize(model, "vanilla")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    eos = _eos_after_three(reference, ids, mask)
    streams = []
    for m in (reference, model):
        s = Recorder()
        out = m.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=20, pad_token_id=0,
                         eos_token_id=eos, streamer=s)
        streams.append((out.tolist(), s.puts, s.ended))
    assert streams[0] == streams[1]
    assert streams[0][0][0][-1] == eos and len(streams[0][0][0]) < 9 + 20  # it really stopped early


@pytest.mark.parametrize("method,options", [("vanilla", {}),
                                            ("quest", {"budget": 8, "dense_layers": 0, "page_size": 4,
                                                       "dense_below": 0}),
                                            ("snapkv", {"budget": 12, "window": 4}), ("h2o", {"budget": 12})])
def test_returned_cache_is_exactly_the_one_transformers_loop_leaves(method, options):
    """Stopping late and undoing the extra steps (or, for eviction methods, checking every step) leaves the same
    cache as transformers' loop: continuing from it gives the same tokens."""
    _, model = tiny_pair()
    sparsecompile.optimize(model, method, **options)
    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    probe = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=0)
    eos = int(probe[0, -3])  # stops after a few tokens, before max_new_tokens
    runs = []
    for loop in ("ours", "transformers"):
        extra = {} if loop == "ours" else {"custom_generate": type(model)._sample}
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0,
                             eos_token_id=eos, return_dict_in_generate=True, **extra)
        cache = out["cache" if "cache" in out else "past_key_values"]
        state = (out.sequences.tolist(), cache.get_seq_length(), sparsecompile.kv_stats(cache).resident_tokens)
        follow = torch.cat([out.sequences, torch.tensor([[5, 6, 7]])], dim=1)
        cont = model.generate(follow, attention_mask=torch.ones_like(follow), past_key_values=cache,
                              do_sample=False, max_new_tokens=5, pad_token_id=0, return_dict_in_generate=True,
                              output_logits=True)
        runs.append((state, cont.sequences.tolist(), torch.stack(cont.logits)))
        cache.release()
    assert runs[0][:2] == runs[1][:2]
    torch.testing.assert_close(runs[0][2], runs[1][2])  # the continuation saw the same context
    assert patched_model(model).controller.manager.allocator.num_used == 0
