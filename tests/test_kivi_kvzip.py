"""``kvzip+kivi``: KVzip's prompt stays in full precision through its scoring passes and compaction, then the kept
entries are quantized once (``ScoredPromptMixin``, ``KiviStorage.hold`` / ``release_held``).

Against ``kvzip`` alone on the same model and prompt: the same entries are kept in every layer and head (the re-read
scored full-precision keys), and the stored codes are exactly KIVI's quantization of ``kvzip``'s kept K/V, group by
group in slot order (quantized once, from full precision, after the compaction)."""

from __future__ import annotations

import torch
from kivi_checks import assert_quantized_once
from tiny_models import tiny_config
from transformers import AutoModelForCausalLM

import sparsecompile
from sparsecompile.kernels.kivi_quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values
from sparsecompile.kernels.kivi_reference import kivi_view_kv
from sparsecompile.models.hf_patch import patched_model

G, BITS, RESIDUAL = 16, 4, 32
OPTIONS = dict(budget=48, chunk=64, page_size=16, compile=False)


def _run(method: str, **extra):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    sparsecompile.optimize(model, method, **OPTIONS, **extra)
    ids = torch.randint(3, 90, (2, 150), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
    return patched_model(model).controller.manager, out


def test_kvzip_kivi_keeps_kvzips_entries_and_quantizes_them_once():
    dense, dense_out = _run("kvzip")  # (the output holds the cache: its rows stay live)
    kivi, out = _run("kvzip+kivi", bits=BITS, group_size=G, residual=RESIDUAL)
    lay = kivi.layout
    checked = 0
    for row in kivi.live_rows:
        for layer in range(lay.num_layers):
            checked += assert_quantized_once(dense, kivi, row, layer, BITS, G)
    assert checked > 0 and dense_out.sequences.shape == out.sequences.shape
    stats = sparsecompile.kv_stats(out.cache if hasattr(out, "cache") else out.past_key_values)
    assert stats.resident_tokens == sum(len(p) for r in dense.live_rows for layer in range(lay.num_layers)
                                        for p in dense.retained_positions(r, layer))


def test_kvzip_kivi_decodes_like_kvzip_at_four_bits():
    """Greedy continuation after the compaction: 4-bit storage of the same kept entries gives kvzip's tokens here."""
    torch.manual_seed(0)
    outs = []
    for method, extra in (("kvzip", {}), ("kvzip+kivi", dict(bits=BITS, group_size=G, residual=RESIDUAL))):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
        sparsecompile.optimize(model, method, **OPTIONS, **extra)
        ids = torch.randint(3, 90, (2, 150), generator=torch.Generator().manual_seed(1))
        outs.append(model.generate(ids, max_new_tokens=6, do_sample=False))
    assert torch.equal(outs[0], outs[1])


def test_kvzip_kivi_serves_like_kvzip():
    """Under continuous batching (four prompts past the budget re-read in one scoring pass, compacted, then decoded
    over 4-bit pages), the engine's kvzip+kivi follows kvzip's greedy tokens (the 8th of one prompt flips on this
    random model: quantization noise on a near tie) and frees every page."""
    from test_llm import prompts_of, tiny_llm

    from sparsecompile import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = prompts_of((90, 70, 120, 60))
    outs = []
    for method, extra in (("kvzip", {}), ("kvzip+kivi", dict(bits=BITS, group_size=G, residual=RESIDUAL))):
        _, llm = tiny_llm(method, budget=48, chunk=64, page_size=16, max_num_batched_tokens=512, **extra)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        stats = llm.llm_engine.stats()
        assert stats.free_pages == stats.total_pages
    assert [t[:7] for t in outs[0]] == [t[:7] for t in outs[1]]


def test_held_buffers_of_two_parts_join_and_release_per_row():
    """Two prompt parts of one mixed forward both held (``hold`` twice before the scoring passes): one buffer, padded
    to the wider, rows in order; ``release_held`` quantizes each row from its own slice, from slot 0, and the rest
    stay held."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    sparsecompile.optimize(model, "kvzip+kivi", bits=BITS, group_size=G, residual=RESIDUAL, **OPTIONS)
    controller = patched_model(model).controller
    controller.reserve(2, 96, 1)
    manager, (a, b) = controller.manager, controller.add_sequences(2)
    st, lay = manager.storage, manager.layout
    H, D = lay.num_kv_heads, lay.head_dim
    counts = {a: 64, b: 80}
    manager.ensure_slots([a, b], [[counts[a]] * lay.num_layers, [counts[b]] * lay.num_layers])
    manager.flush()  # (a step's start does this)
    buffers = {}
    for row, width in ((a, 64), (b, 96)):  # W [1, H, width + 1, D] per layer (the last column: trash)
        st._defer, st._step_rows = True, [row]
        st._work = {layer: (torch.randn(1, H, width + 1, D), torch.randn(1, H, width + 1, D))
                    for layer in range(lay.num_layers)}
        buffers[row] = dict(st._work)
        st.hold()
    assert st._held_rows == [a, b] and all(k.shape == (2, H, 97, D) for k, _ in st._held.values())
    st.release_held([b])
    assert st._held_rows == [a] and all(k.shape[0] == 1 for k, _ in st._held.values())
    for layer in range(lay.num_layers):  # b's quantized prefix is KIVI's quantization of its own buffer
        quantized = int(st.spec.quantized(counts[b]))
        index = torch.as_tensor(manager._host_table[b, layer])[None, None, :].expand(1, H, -1)
        got_k, got_v, _, _ = kivi_view_kv(*st.page_tensors(), manager.pos_pool, st.ring_k, st.ring_v,
                                          torch.tensor([b * lay.num_layers + layer]), index,
                                          torch.full((1, H), counts[b]), torch.tensor([quantized]), counts[b])
        k, v = (t[0, :, :quantized] for t in buffers[b][layer])
        kc, ks, kz = quantize_keys(k.unflatten(1, (quantized // G, G)), BITS, st.spec.scale_dtype)
        assert torch.equal(got_k[0, :, :quantized], dequantize_keys(kc, ks, kz).flatten(1, 2))
        vc, vs, vz = quantize_values(v, BITS, st.spec.scale_dtype, G)
        assert torch.equal(got_v[0, :, :quantized], dequantize_values(vc, vs, vz))
        # and its residual went to the ring in full precision
        assert torch.equal(got_k[0, :, quantized:counts[b]], buffers[b][layer][0][0, :, quantized:counts[b]])
    st.release_held([a])
    assert st._held_rows == [] and st._held == {}
