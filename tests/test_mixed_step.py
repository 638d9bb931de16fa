"""The serving engine's mixed step: a step's decode tokens and its prompt chunks in one forward
(``runtime/mixed.py``). Tokens equal the per-prompt ``generate()`` and the unmixed engine; each step runs one
forward; a method's per-step plan (eviction targets, KIVI's deferred commit) stays with its own part."""

from __future__ import annotations

import pytest
import torch
from test_llm import GREEDY, LENGTHS, prompts_of, reference_tokens, tiny_llm

import sparsecompile


def record_forwards(llm, patch=setattr) -> list[str]:
    """Record, in order, each engine step (``"step"``) and the controller entry of each of its forwards (``"decode"``,
    ``"prefill"``, ``"mixed"``); ``patch``: pytest's ``monkeypatch.setattr`` to undo it afterwards."""
    engine, calls = llm.llm_engine, []
    for owner, name in ((engine.controller, "decode"), (engine.controller, "prefill"), (engine.controller, "mixed"),
                        (engine, "step")):
        original = getattr(owner, name)
        patch(owner, name, lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k))
    return calls


def forwards(calls: list[str]) -> list[str]:
    """The forwards of :func:`record_forwards`' record, without the step marks."""
    return [c for c in calls if c != "step"]


def forwards_per_step(calls: list[str]) -> list[set[str]]:
    """The entries of each step's forwards (steps without a forward left out)."""
    return [set(s.split()) for s in " ".join(calls).split("step") if s.strip()]


def test_a_step_that_decodes_and_prefills_runs_one_forward(monkeypatch):
    reference, llm = tiny_llm(max_num_batched_tokens=64)
    record = record_forwards(llm, monkeypatch.setattr)
    prompts = prompts_of(LENGTHS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    calls = forwards(record)
    assert "mixed" in calls
    steps = llm.llm_engine.stats().steps
    assert len(calls) == steps  # one forward per step: nothing ran a decode forward beside a prompt chunk
    _, unmixed = tiny_llm(max_num_batched_tokens=64, enable_mixed_chunk=False)
    record = record_forwards(unmixed, monkeypatch.setattr)
    assert [o.outputs[0].token_ids for o in unmixed.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]
    separate = forwards(record)
    assert "mixed" not in separate and len(separate) > unmixed.llm_engine.stats().steps


@pytest.mark.parametrize("method,options", [
    ("h2o", {"budget": 16}),  # decode evicts every step: its targets must not be the prefill part's
    ("snapkv+kivi", {"budget": 24, "window": 4, "residual": 16, "group_size": 16}),  # deferred commit, quantized
    ("kivi", {"residual": 16, "group_size": 16, "bits": 4}),
    # a decode selection over quantized pages beside prompt chunks
    ("quest+kivi", {"budget": 48, "dense_layers": 0, "dense_below": 0, "residual": 16, "group_size": 16}),
])
def test_mixed_steps_keep_each_parts_plan(method, options, monkeypatch):
    reference, llm = tiny_llm(method, max_num_batched_tokens=64, **options)
    record = record_forwards(llm, monkeypatch.setattr)
    sparsecompile.optimize(reference, method, page_size=4, prefill_chunk_size=16, **options)
    prompts = prompts_of(LENGTHS, seed=3)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert "mixed" in record
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    stats = llm.llm_engine.stats()
    assert stats.free_pages == stats.total_pages


def test_prompt_logprobs_and_sampling_in_a_mixed_step():
    """A chunk asking for prompt logprobs rides in a mixed step: every position's logits come back; seeded sampling
    gives the same tokens as in the unmixed engine."""
    from sparsecompile import SamplingParams

    prompts = prompts_of((30, 7, 19, 44, 12), seed=5)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=8, prompt_logprobs=2 if i % 2 else None,
                             logprobs=1) for i in range(len(prompts))]
    results = []
    for mixed in (True, False):
        _, llm = tiny_llm(max_num_seqs=2, max_num_batched_tokens=64, enable_mixed_chunk=mixed)
        results.append(llm.generate(prompts, params, use_tqdm=False))
    for a, b in zip(*results):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if a.prompt_logprobs is not None:
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        else:
            assert b.prompt_logprobs is None


def test_a_model_without_logits_to_keep_still_mixes(monkeypatch):
    """The patched forward of a model that ignores ``logits_to_keep`` returns every position: the controller picks
    the decode tokens' and the chunks' last ones itself."""
    reference, llm = tiny_llm(max_num_batched_tokens=64)
    patched = llm.llm_engine.patched
    inner = patched.inner
    monkeypatch.setattr(patched, "inner", lambda **kw: inner(**{**kw, "logits_to_keep": 0}))
    prompts = prompts_of(LENGTHS)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)


def test_mixed_step_layout_round_trips():
    from sparsecompile.runtime.mixed import MixedStep
    from sparsecompile.runtime.step import StepState

    cpu = torch.device("cpu")
    decode = StepState.build([0, 1], torch.ones(2, 1, dtype=torch.bool), torch.tensor([[5], [9]]), is_prefill=False,
                             is_last_chunk=False, device=cpu)
    wide = StepState.build([2, 3], torch.tensor([[False, True, True], [True, True, True]]), torch.arange(6).view(2, 3),
                           is_prefill=True, is_last_chunk=[True, False], device=cpu)
    narrow = StepState.build([4], torch.ones(1, 2, dtype=torch.bool), torch.tensor([[7, 8]]), is_prefill=True,
                             is_last_chunk=True, device=cpu)
    step = MixedStep([decode, wide, narrow], [])
    x = torch.randn(1, 4, 2 + 6 + 2, 8)  # [1, heads, T, D]
    parts = step.split(x)
    assert [tuple(p.shape) for p in parts] == [(2, 4, 1, 8), (2, 4, 3, 8), (1, 4, 2, 8)]
    assert torch.equal(step.join([p.transpose(1, 2) for p in parts]), x.transpose(1, 2))


@pytest.mark.parametrize("method,options", [
    ("snapkv", {"budget": 16, "window": 4}),  # both groups compact at their prompt's end: scores kept per step
    ("snapkv+kivi", {"budget": 24, "window": 4, "residual": 16, "group_size": 16}),  # and deferred commits
])
def test_groups_of_different_lengths_share_the_forward(method, options, monkeypatch):
    """Chunks that do not pad well together (60 tokens beside 22 and 14) form groups, and every group of a step
    rides in the one forward, each group a prefill step of its own."""
    reference, llm = tiny_llm(method, max_num_batched_tokens=96, prefill_chunk_size=64, **options)
    sparsecompile.optimize(reference, method, page_size=4, prefill_chunk_size=64, **options)
    controller, shapes = llm.llm_engine.controller, []
    original = controller.mixed
    monkeypatch.setattr(controller, "mixed",
                        lambda inner, rows, ids, pos, groups: shapes.append((len(rows), len(groups)))
                        or original(inner, rows, ids, pos, groups))
    prompts = prompts_of((60, 22, 50, 9, 35), seed=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    assert shapes[0] == (0, 2)  # the first step: two groups, nothing decoding yet
    assert any(d > 0 and g > 0 for d, g in shapes)


@pytest.mark.slow
def test_compiled_prefill_forwards_give_the_eager_tokens(monkeypatch):
    """``compile_prefill``: prefill and mixed-step forwards run compiled (each attention layer one opaque
    ``sparsecompile::attend``, the method's Python as in eager mode): same tokens as the eager engine, with the
    compiled forward really taking the steps (SnapKV evicts inside it: its prompts are longer than the budget).
    Dynamo, dynamic shapes and the opaque op as in production, AOTAutograd without inductor's code generation
    (``aot_eager``: 40 s less of the suite on two cores; inductor's runs on the GPU, ``serving_burst --modes
    compiled``)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import sparsecompile.models.compiled_forward as compiled_forward
    from sparsecompile.models.compiled_forward import CompiledForward
    from sparsecompile.runtime import compilation

    graphs = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(compiled_forward, "compile_forward",
                        lambda fn, **kw: compilation.compile_forward(fn, graphs, **kw))

    method, options = "snapkv", {"budget": 24, "window": 4}  # the evicting case
    model, llm = tiny_llm(method, max_num_batched_tokens=64, compile_prefill=True, **options)
    engine = llm.llm_engine
    assert isinstance(engine._forward, CompiledForward)
    ran = []
    (cls, compiled), = engine._forward.compiled.items()
    engine._forward.compiled[cls] = lambda layer, hidden, *a, **kw: ran.append(hidden.shape) or compiled(
        layer, hidden, *a, **kw)
    record = record_forwards(llm, monkeypatch.setattr)
    prompts = prompts_of(LENGTHS, seed=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _, eager = tiny_llm(method, max_num_batched_tokens=64, **options)
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    layers = model.config.num_hidden_layers
    assert "mixed" in record and len(ran) == layers * (forwards(record).count("mixed")
                                                        + forwards(record).count("prefill"))
    # regional compilation with a dynamic token count: one graph serves every layer (the layer index is symbolic)
    # and nine token counts, plus a variant for size-1 dims (dynamo specializes them: batch 1 or more)
    assert graphs.frame_count <= 2 < len({shape[1] for shape in ran})
    stats = engine.stats()
    assert stats.free_pages == stats.total_pages


@pytest.mark.parametrize("method,options", [("vanilla", {}),
                                            ("quest", {"budget": 16, "dense_layers": 0, "dense_below": 0})])
def test_replayed_mixed_steps_give_the_eager_tokens(method, options):
    """Recorded mixed steps (``runtime/mixed_graphs.py``), with the CPU stand-in of a CUDA graph: a replay reruns the
    step over the shape's persistent inputs only, so any input not refilled for the new step (rows, positions,
    offsets, token ids, kept positions) would show as other tokens. Steps of one shape run eagerly once, then
    replay; shapes outside the canonical layout (prompt logprobs, too much padding) run the ordinary way."""
    from sparsecompile import SamplingParams
    from sparsecompile.runtime.mixed_graphs import RerunRecorder, width_bucket

    assert [width_bucket(w) for w in (1, 16, 17, 24, 25, 33, 48, 49, 97, 300, 512)] == \
        [16, 16, 24, 24, 32, 48, 48, 64, 128, 384, 512]
    reference, llm = tiny_llm(method, max_num_batched_tokens=40, max_num_seqs=4, **options)
    sparsecompile.optimize(reference, method, page_size=4, prefill_chunk_size=16, **options)
    engine = llm.llm_engine
    assert not engine.replays_mixed_steps  # CPU: off by default (CUDA graphs)
    assert engine.controller.replay_mixed_steps(engine.graph_sizes, engine.max_num_batched_tokens, RerunRecorder())
    replays = engine.controller.mixed_replays
    prompts = prompts_of(LENGTHS + (45, 30, 16, 16, 16, 16), seed=11)
    params = [SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1 if i == 12 else None)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, 12)
    assert replays.replayed > 0 and len(replays._recorded) > 1
    _, eager = tiny_llm(method, max_num_batched_tokens=40, max_num_seqs=4, **options)
    logprobs = eager.generate(prompts, params, use_tqdm=False)[12].prompt_logprobs
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for a, b in zip(outs[12].prompt_logprobs[1:], logprobs[1:])
               for t in a)
    stats = engine.stats()
    assert stats.free_pages == stats.total_pages
    m = engine.controller.manager  # recorded steps hold the pool's addresses: a grown pool voids them
    assert not replays._stale(engine._forward)
    m.grow(m.num_pages + 64, m.max_seqs, m.max_pages_per_seq)
    assert replays._stale(engine._forward) and not replays._stale(engine._forward)


def test_methods_that_cannot_replay_mixed_steps_say_so():
    from sparsecompile.runtime.mixed_graphs import RerunRecorder

    _, llm = tiny_llm("h2o", max_num_batched_tokens=40, budget=16)
    controller = llm.llm_engine.controller
    assert not controller.replay_mixed_steps([1, 2, 4], 40, RerunRecorder()) and controller.mixed_replays is None


def test_a_mixed_step_that_cannot_be_recorded_runs_op_by_op(caplog):
    """A forward whose recording fails (on CUDA: an op that syncs with the host inside the capture) gives a warning,
    that step and every later one run the ordinary way, and the tokens stay right."""
    from sparsecompile.runtime.mixed_graphs import RerunRecorder

    class Failing(RerunRecorder):
        def record(self, fn):
            raise RuntimeError("operation not permitted when stream is capturing")

    reference, llm = tiny_llm(max_num_batched_tokens=40, max_num_seqs=4)
    engine = llm.llm_engine
    engine.controller.replay_mixed_steps(engine.graph_sizes, engine.max_num_batched_tokens, Failing())
    prompts = prompts_of(LENGTHS + (45, 30, 16, 16, 16, 16), seed=11)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(reference, prompts, GREEDY.max_tokens)
    replays = engine.controller.mixed_replays
    assert replays.disabled and replays.replayed == 0
    assert "could not be recorded" in caplog.text
