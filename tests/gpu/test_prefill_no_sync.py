"""CUDA-only (skipped without a GPU): an eager chunked prefill queues its work without host synchronisation.

A blocking host <-> device copy (``torch.as_tensor(array, device="cuda")``, ``torch.tensor(values, device="cuda")``,
``.to("cuda")`` from pageable memory, ``.item()``, ``.cpu()``) drains the GPU queue; inside the per-layer loop
that leaves the GPU idle while Python queues the next kernels. Under ``torch.cuda.set_sync_debug_mode("error")``
every such call raises.

What is checked: the engine's whole per-chunk path, run under "error" mode: the controller's host work before
the forward (``_begin``: page allocation, the method's ``prepare_step``, ``CacheManager.flush``), every layer's
``attend`` (K/V write, selection, view, attention, the method's layer hooks: SnapKV window scores, H2O
accumulation), the method's ``finish_step`` (prefill eviction) and ``_end`` (``commit_step``: truncation, decode
limits). What is not: the code around it, which synchronises at most once per chunk or per call and is not the
engine's to change here: transformers' own forward (``create_causal_mask`` tests ``position_ids`` for packed
sequences with a data-dependent ``.all()`` once per forward), the patched HF ``forward`` (``valid.sum().max()``
of a device attention mask when it sizes the cache) and ``StepState.build``, which copies the step's
positions / mask to the host once per chunk.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter

import pytest
import torch

from sparsecompile.models.hf_patch import patched_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHUNK = 64
BUDGET = 64
# (method, options, evicts): pyramidkv's beta=2 gives real per-layer budgets (96, 64, 32) for the 320-token prompt;
# omnikv keeps every token (its prefill only records each row's prompt length, in prepare_step).
METHODS = [
    ("vanilla", {}, False),
    ("snapkv", {"budget": BUDGET}, True),
    ("pyramidkv", {"budget": BUDGET, "window": 8, "beta": 2}, True),
    ("h2o", {"budget": BUDGET}, True),
    ("streamingllm", {"budget": BUDGET}, True),
    ("omnikv", {"budget": BUDGET}, False),
]


@contextlib.contextmanager
def _no_sync():
    """Any synchronising CUDA call raises inside (the previous mode comes back afterwards)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _strict(fn, calls: Counter, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        with _no_sync():
            return fn(*args, **kwargs)

    return wrapper


def test_sync_debug_mode_catches_a_blocking_copy():
    """The mechanism the test below relies on: a pageable host -> device copy raises in "error" mode, the pinned,
    non-blocking copy the engine uses (``runtime.host.to_device``) does not."""
    from sparsecompile.runtime.host import to_device

    try:
        with pytest.raises(RuntimeError, match="synchroniz"), _no_sync():
            torch.tensor([1, 2, 3], device="cuda")
        with _no_sync():
            got = to_device([1, 2, 3], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got.device.type == "cuda" and got.dtype == torch.int64 and got.tolist() == [1, 2, 3]


@pytest.mark.parametrize("lengths", [(320,), (320, 40)], ids=["one", "left-padded"])
@pytest.mark.parametrize("method,options,evicts", METHODS, ids=[m for m, _, _ in METHODS])
def test_chunked_prefill_has_no_host_sync(method, options, evicts, lengths):
    from tiny_models import left_padded_batch, tiny_config
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=256, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda", torch.bfloat16).eval()
    sparsecompile.optimize(model, method, compile=False, page_size=16, prefill_chunk_size=CHUNK, **options)
    controller = patched_model(model).controller
    ids, mask = (t.cuda() for t in left_padded_batch(lengths))
    tokens = ids.shape[1]
    chunks = -(-tokens // CHUNK)
    assert chunks >= 4 and max(lengths) > BUDGET  # several chunks, and a prompt the eviction methods compress

    def prefill():
        out = model(input_ids=ids, attention_mask=mask)
        return out, out["cache"] if "cache" in out else out["past_key_values"]

    _, cache = prefill()  # warm-up: Triton compiles, allocators (device and pinned host) fill their caches
    cache.release()
    torch.cuda.synchronize()

    calls = Counter()
    controller._begin = _strict(controller._begin, calls, "begin")
    controller._end = _strict(controller._end, calls, "end")
    controller.attend = _strict(controller.attend, calls, "attend")
    controller.runtime.finish_step = _strict(controller.runtime.finish_step, calls, "finish_step")
    try:
        out, cache = prefill()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for name in ("_begin", "_end", "attend"):
            controller.__dict__.pop(name, None)
        controller.runtime.__dict__.pop("finish_step", None)
    torch.cuda.synchronize()
    assert calls == {"begin": chunks, "end": chunks, "finish_step": chunks, "attend": chunks * config.num_hidden_layers}
    assert torch.isfinite(out.logits.float()).all()

    # The checked path did its work: the eviction methods compressed the long prompt, the others kept every token.
    counts = controller.manager.slot_count_array(cache.rows)
    for i, n in enumerate(lengths):
        if not evicts or n <= BUDGET:
            assert (counts[i] == n).all(), (method, n, counts[i])
        else:
            assert (counts[i] < n).all(), (method, n, counts[i])
    cache.release()
