"""Quest and OmniKV on tiny models and hand-built caches: page metadata upkeep, page choice, index reuse
across layers, decode tokens always read, tokens-read statistics, config errors, CLI flags, compiled decode."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from compiled_code import pool_sized_buffers
from tiny_models import ARCHITECTURES, left_padded_batch, tiny_pair

import sparsecompile
from sparsecompile.kernels.omnikv_scores import omnikv_scores_reference
from sparsecompile.methods import MethodConfigError, make_config
from sparsecompile.methods.quest import KMAX, KMIN, QuestConfig, QuestRuntime
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.runtime.cache_manager import CacheManager, KVLayout
from sparsecompile.runtime.contract import LayerContext
from sparsecompile.runtime.model_info import ModelInfo
from sparsecompile.runtime.step import StepState

GREEDY = dict(max_new_tokens=10, do_sample=False)


def _controller(model):
    return patched_model(model).controller


def _cache(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


# ------------------------------------------------------------------ dense-equivalent on every tiny architecture
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_budget_covering_everything_equals_unpatched_model(model_type):
    """Budget >= sequence length: every architecture (sliding windows included) gives the unpatched tokens."""
    for method, options in (("quest", dict(budget=64, dense_layers=0, dense_below=0)),
                            ("omnikv", dict(budget=64, filter_layers="0", dense_below=0))):
        reference, model = tiny_pair(model_type, seed=7)
        ids, mask = left_padded_batch((13, 9, 5), seed=8)
        want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
        sparsecompile.optimize(model, method, page_size=4, prefill_chunk_size=4, **options)
        assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **GREEDY), want), method


# ------------------------------------------------------------------ Quest: page metadata upkeep
def _check_summaries(manager, rows, layers):
    """Every page's stored min / max equals the min / max of the keys it holds (partial last page included)."""
    P = manager.layout.page_size
    kmin, kmax = manager.page_metadata[KMIN], manager.page_metadata[KMAX]
    for row in rows:
        for layer in layers:
            n = manager.slot_counts(row)[layer]
            for i, page in enumerate(manager.pages_of(row, layer)):
                keys = manager.k_pool[page, :, : min(P, n - i * P)]  # [kv_heads, fill, head_dim]
                assert torch.equal(kmin[page], keys.amin(1)) and torch.equal(kmax[page], keys.amax(1)), (row, layer, i)


@pytest.mark.parametrize("dense_below", [0, 33])
def test_quest_page_metadata_follows_every_write(dense_below):
    """The key bounds of every page and layer follow every write, in prefill, in selecting decode steps and in
    dense-read ones (``dense_below`` 33: the batch below holds 27 prompt tokens, so its first three decode steps
    read densely and the rest select over the bounds those steps kept)."""
    _, model = tiny_pair("llama", seed=1, num_hidden_layers=3)
    sparsecompile.optimize(model, "quest", budget=8, dense_layers=1, page_size=4, prefill_chunk_size=3,
                           dense_below=dense_below)
    controller = _controller(model)
    runtime, seen = controller.runtime, []
    original = runtime.commit_step

    def commit_and_check(manager, step):
        original(manager, step)
        _check_summaries(manager, step.row_ids, layers=(0, 1, 2))
        seen.append("prefill" if step.is_prefill else step.variant)

    runtime.commit_step = commit_and_check
    ids, mask = left_padded_batch((13, 9, 5))
    model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    decode = GREEDY["max_new_tokens"] - 1
    dense = 3 if dense_below else 0
    assert seen == ["prefill"] * 5 + ["dense"] * dense + ["sparse"] * (decode - dense)
    # Freed pages come back with stale summaries (poisoned here): the first write into a page must reset them.
    manager = controller.manager
    manager.page_metadata[KMIN].fill_(-1e9)
    manager.page_metadata[KMAX].fill_(1e9)
    ids, mask = left_padded_batch((7, 10), seed=9)
    model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert len(seen) == 5 + 9 + 4 + 9


@pytest.mark.parametrize("method,options", [("quest", dict(budget=8, dense_layers=1, page_size=4)),
                                            ("omnikv", dict(budget=8, filter_layers="0", page_size=4))])
def test_selection_reads_short_batches_densely(method, options):
    """Below ``dense_below`` tokens in the batch a decode step reads every slot: the tokens equal the unpatched
    model's and every layer reports reading all it holds. A batch that grows past it switches to selecting
    (38 prompt tokens, 2 more a step: three dense steps under 42); the automatic threshold is 160 MiB of KV per
    layer."""
    reference, model = tiny_pair("llama", seed=2, num_hidden_layers=3)
    sparsecompile.optimize(model, method, dense_below=10_000, **options)
    ids, mask = left_padded_batch((21, 17), seed=5)
    want = reference.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, want)
    stats = sparsecompile.kv_stats(_cache(out))
    assert all(layer.tokens_read == layer.resident_tokens for layer in stats.layers)
    _cache(out).release()
    sparsecompile.restore(model)

    sparsecompile.optimize(model, method, dense_below=42, **options)
    runtime, seen = _controller(model).runtime, []
    prepare = runtime.prepare_step
    runtime.prepare_step = lambda manager, step: (step.is_prefill or seen.append(step.variant), prepare(manager, step))
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    assert seen == ["dense"] * 3 + ["sparse"] * (GREEDY["max_new_tokens"] - 4)
    stats = sparsecompile.kv_stats(_cache(out))
    assert all(layer.tokens_read < layer.resident_tokens for layer in stats.layers if layer.layer >= 1)
    _cache(out).release()
    sparsecompile.restore(model)

    sparsecompile.optimize(model, method, **options)  # the automatic threshold
    runtime, layout = _controller(model).runtime, _controller(model).layout
    model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    assert runtime.dense_below == (160 << 20) // (layout.num_kv_heads * 2 * layout.head_dim * 4)
    with pytest.raises(ValueError, match="dense_below must be a number of tokens >= 0"):
        sparsecompile.optimize(reference, method, dense_below=-1)


def test_page_metadata_grows_with_the_pool():
    """Regression: CacheManager.grow re-registers page metadata at the *new* pool size, keeping its contents."""
    manager = CacheManager(KVLayout(1, 2, 4, 4, torch.float32, torch.device("cpu")), 8, 2, 4)
    meta = manager.register_page_metadata("probe", (4,), torch.float32)
    meta.copy_(torch.arange(meta.numel(), dtype=torch.float32).view_as(meta))
    before = meta[:8].clone()
    manager.grow(32, 2, 4)
    grown = manager.page_metadata["probe"]
    assert grown.shape == (32 + 1, 2, 4) and torch.equal(grown[:8], before)


# ------------------------------------------------------------------ Quest: page choice on a hand-built cache
L, H, GROUP, D, P = 1, 2, 2, 8, 4


def _quest_setup(budget):
    info = ModelInfo("llama", L, H * GROUP, H, D, ("layer0",), None)
    runtime = QuestRuntime(QuestConfig(budget=budget, dense_layers=0, dense_below=0), info)
    manager = CacheManager(KVLayout(L, H, D, P, torch.float32, torch.device("cpu")), 64, 4, 16)
    runtime.setup(manager)
    return runtime, manager


def _forward(runtime, manager, rows, keys, positions, valid, prefill, query=None):
    """Write ``keys [batch, H, tokens, D]`` as one step and return the runtime's selection."""
    step = StepState.build(rows, valid, positions, is_prefill=prefill, is_last_chunk=prefill,
                           device=torch.device("cpu"))
    counts = manager.slot_count_array(rows) + np.asarray(step.num_new_host)[:, None]
    manager.ensure_slots(rows, counts)
    runtime.prepare_step(manager, step)
    manager.flush()
    new_slots = manager.write(0, step, keys, keys)
    if query is None:
        query = torch.zeros(len(rows), H * GROUP, keys.shape[2], D)
    ctx = LayerContext(0, step, manager, query, keys, keys, new_slots, D ** -0.5, 0)
    selection = runtime.build_prefill_selection(ctx) if prefill else runtime.build_decode_selection(ctx)
    return step, selection


def _naive_page_scores(manager, row, query):
    """Per KV head and row-local page: max over the group of sum_c max(q_c min_c, q_c max_c) (from the keys)."""
    n = manager.slot_counts(row)[0]
    out = torch.empty(H, len(manager.pages_of(row, 0)))
    for i, page in enumerate(manager.pages_of(row, 0)):
        keys = manager.k_pool[page, :, : min(P, n - i * P)]
        lo, hi = keys.amin(1), keys.amax(1)
        for h in range(H):
            q = query[h * GROUP:(h + 1) * GROUP]
            out[h, i] = torch.maximum(q * lo[h], q * hi[h]).sum(-1).max()
    return out


def test_quest_reads_top_pages_and_current_page():
    budget = 12  # 3 pages of 4, the current one included
    runtime, manager = _quest_setup(budget)
    lengths = (25, 10, 16)  # 7 pages (partial last), 3 pages (<= budget: read all), 4 full pages
    rows = [manager.add_sequence() for _ in lengths]
    width = max(lengths)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(len(rows), H, width, D, generator=g) * torch.linspace(0.2, 3, width)[:, None]
    valid = torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]  # left padding
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    _forward(runtime, manager, rows, keys, positions, valid, prefill=True)
    query = torch.randn(len(rows), H * GROUP, 1, D, generator=g)
    new = torch.randn(len(rows), H, 1, D, generator=g)
    step, sel = _forward(runtime, manager, rows, new, torch.tensor(lengths)[:, None],
                         torch.ones(3, 1, dtype=torch.bool), prefill=False, query=query)
    assert sel.pages.shape == (3, H, 3)
    for b, row in enumerate(rows):
        n = lengths[b] + 1
        n_pages = -(-n // P)
        scores = _naive_page_scores(manager, row, query[b, :, 0])
        for h in range(H):
            if n <= budget:
                want, tokens = list(range(n_pages)), n
            else:
                others = scores[h, : n_pages - 1]
                ranked = torch.sort(others, descending=True).values
                assert ranked[1] - ranked[2] > 1e-4  # separated scores: the expected set is unambiguous
                want = sorted(torch.topk(others, budget // P - 1).indices.tolist() + [n_pages - 1])
                tokens = (budget // P - 1) * P + (n - (n_pages - 1) * P)
            keep = len(want)
            assert sel.pages[b, h, :keep].tolist() == want and (sel.pages[b, h, keep:] == -1).all()
            assert int(sel.tokens[b, h]) == tokens
    view = manager.build_view(0, step, sel)  # the attention reads exactly those pages of the block table
    table = manager.block_table[step.rows, 0]
    assert torch.equal(view.index[0, 0, :3], table[0, sel.pages[0, 0]].to(torch.int32))
    assert view.lengths.tolist() == sel.tokens.tolist()


# ------------------------------------------------------------------ OmniKV: one index set per filter layer, reused
def test_omnikv_sparse_layers_read_the_filter_set_plus_decode_tokens():
    _, model = tiny_pair("llama", seed=2, num_hidden_layers=4)
    budget = 3
    sparsecompile.optimize(model, "omnikv", budget=budget, filter_layers="0,2", page_size=4, prefill_chunk_size=5,
                           dense_below=0)
    controller = _controller(model)
    runtime, manager = controller.runtime, controller.manager
    assert runtime.sparse_layers == {1, 3} and runtime.filter_layers == {0, 2}
    chosen, read = [], []
    observe, build_view = runtime._observe, manager.build_view

    def observe_and_record(ctx):
        observe(ctx)
        rows = ctx.step.rows
        prompt = runtime.prompt[rows]
        scores = omnikv_scores_reference(ctx.query[:, :, -1], manager.k_pool, manager.block_table[rows, ctx.layer],
                                         prompt)
        chosen.append((ctx.layer, runtime.selected[rows, :budget].clone(), runtime.count[rows].clone(), scores,
                       prompt.clone()))

    def build_view_and_record(layer, step, selection=None, max_slots=None):
        if not step.is_prefill:
            read.append((layer, selection, manager.lengths[step.rows, layer].clone()))
        return build_view(layer, step, selection, max_slots)

    runtime._observe, manager.build_view = observe_and_record, build_view_and_record
    ids, mask = left_padded_batch((11, 6, 8), seed=5)
    model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    steps = GREEDY["max_new_tokens"] - 1
    assert [layer for layer, *_ in chosen] == [0, 2] * steps
    assert [layer for layer, *_ in read] == [0, 1, 2, 3] * steps
    for s in range(steps):
        for sparse, filt in ((1, 0), (3, 2)):
            _, selected, count, scores, prompt = chosen[2 * s + filt // 2]
            _, selection, length = read[4 * s + sparse]
            assert read[4 * s + filt][1] is None  # filter layers (and layer 0) are dense
            for b in range(3):
                c, p, n = int(count[b]), int(prompt[b]), int(length[b])
                assert c == min(budget, p)
                top = torch.sort(scores[b, :p], descending=True, stable=True).indices[:c].sort().values
                assert selected[b, :c].tolist() == top.tolist()  # the filter layer's own top-c prompt slots
                want = selected[b, :c].tolist() + list(range(p, n))  # ... then every decode token
                for h in range(manager.layout.num_kv_heads):
                    assert int(selection.counts[b, h]) == len(want)
                    assert selection.slots[b, h, : len(want)].tolist() == want


# ------------------------------------------------------------------ statistics and memory
@pytest.mark.parametrize("method,options", [("quest", dict(budget=8, dense_layers=1, dense_below=0)),
                                            ("omnikv", dict(budget=3, filter_layers="1", dense_below=0))])
def test_tokens_read_follow_forks_and_freed_rows(method, options):
    """A fork read what its source read in its last step; a freed row id taken by a fork of a cache that never
    decoded reports nothing read, not its previous owner's count (it did before 2026-12-04, fifteenth session)."""
    _, model = tiny_pair("qwen2", seed=4, num_hidden_layers=3)
    sparsecompile.optimize(model, method, page_size=4, **options)
    ids, mask = left_padded_batch((13, 9, 5))
    decoded = _cache(model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY))
    prompt_only = _cache(model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                                        max_new_tokens=1, do_sample=False))
    read = [layer.tokens_read for layer in sparsecompile.kv_stats(decoded).layers]
    assert all(n is not None for n in read)
    fork = decoded.fork()
    assert [layer.tokens_read for layer in sparsecompile.kv_stats(fork).layers] == read
    freed = set(decoded.rows) | set(fork.rows)
    decoded.release()
    fork.release()
    again = prompt_only.fork()
    assert set(again.rows) <= freed  # the freed row ids, reused
    assert all(layer.tokens_read is None for layer in sparsecompile.kv_stats(again).layers)
    for cache in (prompt_only, again):
        cache.release()


@pytest.mark.parametrize("method,options", [("quest", dict(budget=8, dense_layers=1, dense_below=0)),
                                            ("omnikv", dict(budget=3, filter_layers="1", dense_below=0))])
def test_tokens_read_reported_next_to_resident(method, options):
    _, model = tiny_pair("qwen2", seed=4, num_hidden_layers=3)
    sparsecompile.optimize(model, method, page_size=4, **options)
    ids, mask = left_padded_batch((13, 9, 5))
    out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
    stats = sparsecompile.kv_stats(_cache(out))
    rows = len(_cache(out).rows)
    for layer in stats.layers:
        assert layer.tokens_read is not None
        dense = layer.layer < 2 if method == "omnikv" else layer.layer < 1
        if dense:
            assert layer.tokens_read == layer.resident_tokens
        else:
            assert layer.tokens_read < layer.resident_tokens
    decode_tokens = GREEDY["max_new_tokens"] - 1
    if method == "omnikv":  # budget prompt tokens + every decode token, per row and KV head
        assert stats.layers[2].tokens_read == rows * 2 * (3 + decode_tokens)
    else:
        assert stats.layers[1].tokens_read <= rows * 2 * 8
        assert stats.metadata_bytes > 0
    assert "tokens read per decode step" in stats.summary()
    _cache(out).release()


def _scramble(runtime, manager):
    """Lose what the prefill built: random Quest summaries, OmniKV's prompt lengths forgotten."""
    if runtime.name == "quest":
        manager.page_metadata[KMIN].normal_()
        manager.page_metadata[KMAX].normal_()
    else:
        runtime.prompt.zero_()


@pytest.mark.parametrize("method,options", [("quest", dict(budget=8, dense_layers=1, dense_below=0)),
                                            ("omnikv", dict(budget=4, filter_layers="1", dense_below=0))])
def test_loaded_kv_rebuilds_method_state(method, options):
    """``on_kv_loaded`` (a KV import, the benchmark's synthetic fill) rebuilds what the prefill built: generation
    after scrambling the state and reloading equals the undisturbed one; without the reload it differs."""
    _, model = tiny_pair("llama", seed=5, num_hidden_layers=3)
    sparsecompile.optimize(model, method, page_size=4, **options)
    controller = _controller(model)
    runtime = controller.runtime
    ids, mask = left_padded_batch((23, 19, 14), seed=6)
    want = model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    original = runtime.commit_step
    outputs = {}
    for reload in (True, False):
        def commit(manager, step, reload=reload):
            original(manager, step)
            if step.is_prefill and step.is_last_chunk:
                _scramble(runtime, manager)
                if reload:
                    runtime.on_kv_loaded(manager, step.row_ids, [int(n) for n in mask.sum(1)])

        runtime.commit_step = commit
        outputs[reload] = model.generate(input_ids=ids, attention_mask=mask, **GREEDY)
    runtime.commit_step = original
    assert torch.equal(outputs[True], want)
    assert not torch.equal(outputs[False], want)  # the scrambling matters: the reload is what fixed it


def test_quest_memory_oracle_reports_metadata_per_page():
    runtime, _ = _quest_setup(16)
    oracle = runtime.memory_oracle(KVLayout(L, H, D, P, torch.bfloat16, torch.device("cpu")))
    assert oracle.metadata_bytes_per_page == 2 * H * D * 2
    assert oracle.bytes_per_page == P * H * 2 * D * 2 + oracle.metadata_bytes_per_page
    assert oracle.admission_cost(10, 6) == {"kv_pages": 4}  # full KV: nothing evicted


# ------------------------------------------------------------------ errors and CLI
@pytest.mark.parametrize("method,options,message", [
    ("quest", dict(quest_page_size=8, dense_layers=1), "differs from the engine page_size=4"),
    ("quest", dict(budget=2, dense_layers=1), "smaller than one page"),
    ("quest", dict(budget=2, quest_page_size=4), "smaller than one page"),
    ("quest", {}, "dense_layers=2 leaves no sparse layer in a 2-layer model"),
    ("quest", dict(budget=0), "budget must be a positive"),
    ("omnikv", dict(budget=8, ratio=0.1), "not both"),
    ("omnikv", dict(filter_layers="0,5"), "out of range for a 2-layer model"),
    ("omnikv", dict(filter_layers="a,b"), "layer indices"),
    ("omnikv", dict(filter_layers="1,1"), "distinct"),
    ("omnikv", dict(ratio=1.5), "ratio must be in (0, 1]"),
    ("omnikv", {}, "fewer than the first default filter layer"),
])
def test_bad_options_raise_clear_errors(method, options, message):
    _, model = tiny_pair("llama")
    with pytest.raises(MethodConfigError, match=re.escape(message)):
        sparsecompile.optimize(model, method, page_size=4, **options)


def test_default_filter_layers_are_clipped_to_the_depth():
    _, model = tiny_pair("llama", num_hidden_layers=10)
    sparsecompile.optimize(model, "omnikv", ratio=0.5, page_size=4)
    runtime = _controller(model).runtime
    assert runtime.filter_layers == {2, 8} and runtime.sparse_layers == {3, 4, 5, 6, 7, 9}


def test_cli_flags_come_from_the_configs():
    from sparsecompile.cli import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "omnikv", "--filter-layers", "1,3",
                                      "--ratio", "0.25"])
    options = {k[len("method_"):]: v for k, v in vars(args).items() if k.startswith("method_") and v is not None}
    assert options == {"filter_layers": "1,3", "ratio": 0.25}
    assert make_config("omnikv", options).filter_layers == (1, 3)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--method", "quest", "--budget", "64",
                                      "--dense-layers", "1", "--quest-page-size", "16"])
    assert (args.method_budget, args.method_dense_layers, args.method_quest_page_size) == (64, 1, 16)


# ------------------------------------------------------------------ compiled decode
@pytest.mark.slow
def test_quest_compiled_decode_equals_eager_one_graph_per_variant():
    """``dense_below`` 22: the first batch (19 prompt tokens) reads densely for two steps, then selects; the second
    (23) selects throughout. One graph per variant, equal to eager decode under the same rule."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, eager = tiny_pair("llama", seed=6, num_hidden_layers=3)
    _, compiled = tiny_pair("llama", seed=6, num_hidden_layers=3)
    options = dict(budget=8, dense_layers=1, page_size=4, dense_below=22)
    sparsecompile.optimize(eager, "quest", compile=False, **options)
    sparsecompile.optimize(compiled, "quest", compile=True, **options)
    for lengths in ((7, 12), (19, 4)):
        ids, mask = left_padded_batch(lengths, seed=len(lengths) + lengths[0])
        want = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False),
                           want)
    assert _controller(compiled)._compiled_shapes == {(2, 2, "dense"), (2, 2, "sparse")}
    assert counters["stats"]["unique_graphs"] == 2
    assert sum(counters["graph_break"].values()) == 0


def test_omnikv_compiled_decode_updates_the_pool_in_place():
    """The filter layer's scores read the key pool that later layers' kv_write mutates. Inductor's locality
    reordering once sank that read past the next write, and the write then went to a whole copy of the pool
    (32 GiB at 128K x 4 on the H200). The compiled graph must equal eager and allocate nothing pool-sized."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, eager = tiny_pair("llama", seed=7, num_hidden_layers=3)
    _, compiled = tiny_pair("llama", seed=7, num_hidden_layers=3)
    options = dict(budget=8, filter_layers="0", page_size=4, num_pages=4096, dense_below=0)
    sparsecompile.optimize(eager, "omnikv", compile=False, **options)
    sparsecompile.optimize(compiled, "omnikv", compile=True, **options)
    ids, mask = left_padded_batch((11, 17), seed=3)
    want = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    got, code = run_and_get_code(compiled.generate, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                 do_sample=False)
    assert torch.equal(got, want)
    assert code and not pool_sized_buffers(code)
    # The sparse layer's slot list, one for all heads, is mapped to global slots once: no [batch, kv_heads,
    # capacity] copy of it per head (47 us a layer at 128K x 4 on the H200).
    heads = compiled.config.num_key_value_heads
    assert heads > 1 and not re.findall(rf"empty_strided_\w+\(\(2, {heads}, \d*\*?s\d+\)", "".join(code))


def test_a_one_token_continuation_is_a_prompt_like_a_longer_one():
    """generate()'s first forward feeds its prompt, even one token long: OmniKV scores prompt tokens and always reads
    decoded ones, so a cropped cache continued with one new token must equal a fresh run (it ran as a decode step)."""
    _, model = tiny_pair(seed=0)
    sparsecompile.optimize(model, "omnikv", page_size=8, budget=8, filter_layers="0", dense_below=0)
    ids, mask = left_padded_batch((8, 19, 23), seed=87)
    kwargs = dict(do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict_in_generate=True, **kwargs)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    cache.crop(ids.shape[1])
    more = torch.randint(3, 95, (3, 1), generator=torch.Generator().manual_seed(87))
    full, full_mask = torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1)
    name = patched_model(model).cache_name
    continued = model.generate(full, attention_mask=full_mask, max_new_tokens=4, **{name: cache}, **kwargs)
    cache.release()
    assert torch.equal(continued, model.generate(full, attention_mask=full_mask, max_new_tokens=4, **kwargs))
