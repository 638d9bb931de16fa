"""The pieces of an exported artifact, without compiling: the decode state list, its rebinding, the
``sparsecompile::attend`` callback op, the exported programs run as torch.export programs, and the fallback form."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from method_matrix import DENSE_EQUIVALENT
from tiny_models import tiny_pair

import sparsecompile
from sparsecompile.models.export_fusion import fuse_projections
from sparsecompile.models.export_programs import ExportError, export_decode, export_prefill
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.runtime.attend_op import attend, serving
from sparsecompile.runtime.state_binding import bound, decode_state
from sparsecompile.runtime.step import StepState


def _patched(method: str, **options):
    _, model = tiny_pair("llama")
    sparsecompile.optimize(model, method, page_size=4, **{**DENSE_EQUIVALENT[method], **options})
    patched = patched_model(model)
    patched.controller.build_pool(41, 5, 16)
    return model, patched


def _pad_step(patched, batch: int = 3) -> None:
    empty = torch.zeros(0, 1, dtype=torch.long)
    patched.controller.decode(patched.inner, [], empty, empty, pad_to=batch)


@pytest.mark.parametrize("method,expected", [
    ("vanilla", []),
    ("h2o", ["slot_metadata.h2o_score", "method._limits"]),
    ("quest", ["page_metadata.quest_kmax", "page_metadata.quest_kmin", "method.reads.read"]),
    ("omnikv", ["method.count", "method.prompt", "method.reads.read", "method.selected"]),
])
def test_decode_state_lists_the_pool_and_every_method_buffer(method, expected):
    _, patched = _patched(method)
    _pad_step(patched)  # Quest / OmniKV create their read counters in the first step
    names = [slot.name for slot in decode_state(patched.controller)]
    assert names == ["manager.k_pool", "manager.v_pool", "manager.pos_pool", "manager.block_table",
                     "manager.lengths", *expected]


def test_bound_points_the_owners_at_other_tensors_and_restores_them():
    _, patched = _patched("h2o", budget=8)
    c = patched.controller
    slots = decode_state(c)
    originals = [slot.get() for slot in slots]
    others = [t.clone()[:-2] if slot.per_page else t.clone() for slot, t in zip(slots, originals)]
    with bound(slots, others):
        assert c.manager.k_pool is others[0] and c.manager.slot_metadata["h2o_score"] is others[5]
        assert c.manager.trash_page == others[0].shape[0] - 1  # follows the bound pool
    assert all(slot.get() is t for slot, t in zip(slots, originals))
    assert c.manager.trash_page == c.manager.num_pages


def test_attend_op_is_the_live_controllers_attention():
    model, patched = _patched("vanilla")
    c = patched.controller
    row = c.add_sequences(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16,
                                                                                                        generator=g)
    step = StepState.build(row, torch.ones(1, 5, dtype=torch.bool), torch.arange(5)[None], is_prefill=True,
                           is_last_chunk=True, device=torch.device("cpu"))
    c._begin(step)
    c.step = step
    try:
        want = c.attend(0, q, k, v, 0.25, 0)
        with serving(c):
            got = attend(q, k, v, 0, 0.25, 0)
            torch.library.opcheck(torch.ops.sparsecompile.attend.default, (q, k, v, 0, 0.25, 0))
        torch.testing.assert_close(got, want)
        with pytest.raises(RuntimeError, match="without a live SparseController"):
            attend(q, k, v, 0, 0.25, 0)
    finally:
        c.step = None


def _twins(method: str, **options):
    """Two identical tiny models patched alike, each with its pool."""
    models = tiny_pair("llama")
    patched = []
    for model in models:
        sparsecompile.optimize(model, method, page_size=4, **{**DENSE_EQUIVALENT[method], **options})
        patched.append(patched_model(model))
        patched[-1].controller.build_pool(41, 5, 16)
        _pad_step(patched[-1])
    return models, patched


@pytest.mark.parametrize("method,options", [("h2o", {"budget": 12}), ("quest", {"budget": 8, "dense_below": 0}),
                                            ("omnikv", {"budget": 6, "dense_below": 0})])
def test_exported_programs_step_like_the_eager_engine(method, options):
    """Twin engines: one eager, one running the exported programs (prefill with attention called back, decode
    with the method traced in and its state as inputs) as plain torch.export programs. Logits and every state
    tensor stay equal through a batched, left-padded, chunked prefill (budgets below the prompt: evicting /
    selecting) and padded decode."""
    (_, model), (eager, served) = _twins(method, **options)
    a, b = eager.controller, served.controller
    program, state = export_decode(model, decode_state(b), 3, 4)
    shared: dict = {}  # q/k/v and gate/up fused, as sparsecompile.export does: one tensor for both programs
    program, fused = fuse_projections(program, shared)
    prefill, fused_prefill = fuse_projections(export_prefill(model, 64, 4), shared)
    assert fused == fused_prefill == 4  # 2 layers x (q/k/v, gate/up)
    assert not any(name.endswith((".q_proj.weight", ".up_proj.weight")) for name in program.state_dict)
    step_program, prefill = program.module(), prefill.module()

    def prefill_inner(input_ids, inputs_embeds, position_ids, logits_to_keep):
        keep = torch.arange(input_ids.shape[1] - logits_to_keep, input_ids.shape[1])
        with serving(b):
            return prefill(input_ids, position_ids, keep)

    b.install_decode_step(lambda inner, step, input_ids, positions: step_program(
        input_ids, positions, step.rows, step.new_offsets, step.num_new, tuple(s.get() for s in state)))
    rows = [c.add_sequences(2) for c in (a, b)]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 96, (2, 19), generator=g)
    valid = torch.ones(2, 19, dtype=torch.bool)
    valid[1, :6] = False  # the second prompt is shorter: left-padded, as the engine batches prompt chunks
    positions = torch.where(valid, valid.long().cumsum(1) - 1, 0)
    want = a.prefill(eager.inner, rows[0], ids, None, positions, valid, 1)
    got = b.prefill(prefill_inner, rows[1], ids, None, positions, valid, 1)
    torch.testing.assert_close(got, want)
    token = torch.tensor([[7], [9]])
    for i in range(5):
        position = torch.tensor([[19 + i], [13 + i]])
        want = a.decode(eager.inner, rows[0], token, position, pad_to=3)
        got = b.decode(None, rows[1], token, position, pad_to=3)
        torch.testing.assert_close(got, want)
        b_state = {slot.name: slot.get() for slot in decode_state(b)}
        for slot in decode_state(a):
            torch.testing.assert_close(b_state[slot.name], slot.get(), msg=slot.name)
        token = want[:, -1].argmax(-1, keepdim=True)


def test_a_loaded_artifact_binds_the_buffers_its_method_creates_in_the_first_step(tmp_path):
    """Quest's (and OmniKV's, the same ``ReadCounter``) read counters are created by the first decode step's host
    hook, so the export holds them in the decode program's state and a freshly loaded KV core does not, until load
    runs a padding-only step before binding. Fallback form run as plain torch.export programs (nothing compiled);
    a selecting budget."""
    from tiny_models import word_tokenizer

    method, options = "quest", {"budget": 24, "dense_layers": 1, "dense_below": 0}
    _, model = tiny_pair("llama")
    engine = dict(max_num_seqs=4, max_model_len=128, page_size=4, prefill_chunk_size=32, **options)
    path = sparsecompile.export(model, tmp_path / method, method, tokenizer=word_tokenizer(96), form="exported",
                                compile_cache=False, **engine)
    assert any(name.startswith("method.reads") for name in
               json.loads((path / "manifest.json").read_text())["programs"]["decode"]["state"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (60, 41, 13)]
    params = sparsecompile.SamplingParams(temperature=0, max_tokens=12)
    got = [o.outputs[0].token_ids for o in sparsecompile.load(path).generate(prompts, params, use_tqdm=False)]
    eager = sparsecompile.LLM(model, method, tokenizer=word_tokenizer(96), compile=False, **engine)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


def test_a_decode_program_is_traced_in_the_variant_asked_for():
    """Quest's decode variants (``methods/dense_read.py``): the default program selects pages, the ``dense`` one
    reads every slot (no page scores in its graph); a variant the method lacks is refused."""
    model, patched = _patched("quest", budget=8, dense_layers=0)
    _pad_step(patched)
    state = decode_state(patched.controller)

    def scores_pages(program) -> bool:
        return any("quest_page_scores" in str(node.target) for node in program.graph.nodes)

    assert scores_pages(export_decode(model, state, 3, 4)[0])
    assert not scores_pages(export_decode(model, state, 3, 4, "dense")[0])
    with pytest.raises(ValueError, match="no decode variant 'fast'"):
        export_decode(model, state, 3, 4, "fast")


def test_a_decode_hook_reading_host_fields_fails_the_export(monkeypatch):
    model, patched = _patched("vanilla")
    _pad_step(patched)
    runtime = patched.controller.runtime
    monkeypatch.setattr(type(runtime), "finish_step", lambda self, manager, step: list(step.row_ids), raising=False)
    with pytest.raises(ExportError, match="read the step's host fields"):
        export_decode(model, decode_state(patched.controller), 3, 4)


def test_a_package_carrying_its_own_libstdcxx_is_refused_before_it_loads(tmp_path):
    """``check_package`` reads the wrappers' ELF dependencies: a library without ``libstdc++.so.6`` (here the C math
    library, a real ELF file) is refused with the reason; one that needs it (torch's c10) passes."""
    import ctypes.util
    import zipfile
    from pathlib import Path

    from sparsecompile.serving.aoti_linkage import check_package, elf_needed
    from sparsecompile.serving.manifest import ArtifactError

    c10 = next((Path(torch.__file__).parent / "lib").glob("libc10.so*"), None)
    libm = ctypes.util.find_library("m")
    libm_path = next((p for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
                      if libm and (p := Path(d) / libm).exists()), None)
    if c10 is None or libm_path is None or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux ELF libraries (libc10, libm)")
    assert "libstdc++.so.6" in elf_needed(c10.read_bytes())
    assert elf_needed(b"not an ELF file") is None

    def package(name: str, library: Path) -> Path:
        path = tmp_path / f"{name}.pt2"
        with zipfile.ZipFile(path, "w") as archive:
            archive.write(library, f"{name}/data/aotinductor/model/{name}.wrapper.so")
        return path

    check_package(package("good", c10))
    with pytest.raises(ArtifactError, match=r"bad.wrapper.so carries its own static libstdc\+\+"):
        check_package(package("bad", libm_path))


def test_the_weights_reader_gives_safetensors_tensors_at_any_offset(tmp_path):
    check_weights_reader(tmp_path, "cpu")


def check_weights_reader(tmp_path, device: str) -> None:
    """The artifact's weights reader (chunked reads into one buffer, views per tensor) against safetensors' own
    loader: mixed dtypes, sizes that leave later offsets off 16-byte alignment (17 int64s, 3 bf16s: those tensors
    get their own copy, aligned ones stay views of the one buffer), a scalar, an empty tensor, and chunks smaller
    than a tensor (on CUDA: through the ring of pinned buffers)."""
    from safetensors.torch import load_file, save_file

    from sparsecompile.serving.weights_file import load_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"a.odd": torch.randn(3, generator=g).bfloat16(), "b.weight": torch.randn(64, 33, generator=g),
               "c.ids": torch.arange(17, dtype=torch.int64), "d.scalar": torch.tensor(2.5, dtype=torch.float16),
               "e.empty": torch.zeros(0, 4), "f.mask": torch.rand(9, generator=g) > 0.5}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    want = load_file(str(tmp_path / "w.safetensors"))
    got = load_safetensors(tmp_path / "w.safetensors", device, chunk_bytes=1000, threads=2)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert got[name].device.type == device and torch.equal(got[name].cpu(), tensor), name
        assert got[name].data_ptr() % 16 == 0 or got[name].numel() == 0, name
    storage = {name: t.untyped_storage().data_ptr() for name, t in got.items()}
    assert storage["c.ids"] == storage["f.mask"]  # offsets 0 and 8592: views of the one buffer
    assert storage["b.weight"] != storage["c.ids"]  # offset 136: a copy of its own
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated"):
        load_safetensors(tmp_path / "cut.safetensors", device)


@pytest.mark.parametrize("class_path", ["transformers.tokenization_utils_tokenizers:TokenizersBackend", None,
                                        "transformers.no_such_module:Tok", "json:JSONDecoder"])
def test_the_artifact_tokenizer_loads_through_its_recorded_class_or_autotokenizer(class_path, tmp_path):
    from tiny_models import word_tokenizer

    from sparsecompile.serving.artifact import load_tokenizer

    word_tokenizer(64).save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(tmp_path, class_path)  # a module outside transformers is never imported by name
    assert type(tokenizer).__name__ == "TokenizersBackend"
    assert tokenizer("t1 t2 t5").input_ids == [1, 2, 5]


def test_shipped_kernels_fill_only_the_entries_missing_from_the_triton_cache(tmp_path, monkeypatch):
    """``load`` copies an artifact's ``kernels/`` entries (Triton cache entries, written here by Triton's own cache
    manager as the export's trial load does) into this process's Triton cache: a missing entry whole, its group
    file (members by absolute path) pointed at the copies so Triton finds them, an entry already there untouched,
    nothing half-written."""
    cache_module = pytest.importorskip("triton.runtime.cache")
    from sparsecompile.serving.artifact_kernels import install_kernels, triton_cache_dir
    from sparsecompile.serving.manifest import ArtifactError

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "artifact" / "kernels"))
    for key in ("AAAA", "BBBB"):
        manager = cache_module.FileCacheManager(key)
        members = {"k.cubin": manager.put(key.encode() * 3, "k.cubin"), "k.json": manager.put("{}", "k.json")}
        manager.put_group("k.json", members)
    cache = tmp_path / "triton"
    (cache / "BBBB").mkdir(parents=True)
    (cache / "BBBB" / "k.cubin").write_bytes(b"this process's own")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert triton_cache_dir() == cache
    assert install_kernels(tmp_path / "artifact", {"kernels": "kernels"}) == 1
    assert cache_module.FileCacheManager("AAAA").get_group("k.json") == {
        "k.cubin": str(cache / "AAAA" / "k.cubin"), "k.json": str(cache / "AAAA" / "k.json")}
    assert (cache / "AAAA" / "k.cubin").read_bytes() == b"AAAAAAAAAAAA"
    assert (cache / "BBBB" / "k.cubin").read_bytes() == b"this process's own"
    assert sorted(p.name for p in cache.iterdir()) == ["AAAA", "BBBB"]  # no staging directory left behind
    assert install_kernels(tmp_path / "artifact", {"kernels": "kernels"}) == 0
    assert install_kernels(tmp_path / "artifact", {}) == 0  # a CPU artifact ships none
    with pytest.raises(ArtifactError, match="missing"):
        install_kernels(tmp_path / "artifact", {"kernels": "gone"})


def test_a_failed_compile_cache_child_leaves_a_serving_artifact_with_a_warning(tmp_path, monkeypatch, caplog):
    """The fallback form's compile cache comes from a child process that loads the artifact (a second copy of the
    weights): when it fails, export keeps the artifact, which compiles at load, and says why it is not warm."""
    import sparsecompile.serving.artifact_kernels as artifact_kernels
    from sparsecompile.export import _ship_compile_cache
    from sparsecompile.serving.artifact import PhaseTimer
    from sparsecompile.serving.manifest import ArtifactError

    def fail(root, file, timeout=900):
        raise ArtifactError("compiling the exported decode program in a fresh process failed: CUDA out of memory")

    monkeypatch.setattr(artifact_kernels, "compile_decode_cache", fail)
    with caplog.at_level("WARNING", logger="sparsecompile.export"):
        _ship_compile_cache(tmp_path, PhaseTimer())  # no manifest is touched: it would raise on a missing one
    assert "ships no compile cache" in caplog.text and "out of memory" in caplog.text


def test_a_compiled_forward_runs_the_attend_op_without_tracing_its_body():
    """The op's body is the controller's per-step Python: it must run, never be traced. Once one call had traced it
    (here: a step under a TorchDispatchMode, which makes dynamo run the forward eagerly while its frame hook stays
    live, as ``benchmarks/step_ops.py`` counts ops), every later step's new objects failed the guards and recompiled
    it up to dynamo's limit."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils._python_dispatch import TorchDispatchMode

    from sparsecompile.runtime.compilation import apply_deferred_marks

    class StepObject:
        def __init__(self, shift: float) -> None:
            self.shift = shift

    class StubController:
        step = StepObject(0.0)
        traced = 0

        def attend(self, layer, query, key, value, scale, window):
            self.traced += torch.compiler.is_compiling()
            return (query * scale + self.step.shift).transpose(1, 2).contiguous()

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    apply_deferred_marks()  # what every sparsecompile path to torch.compile runs first
    graphs = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q: attend(q, q, q, 0, 0.5, 0) + 1, backend=graphs)
    q = torch.randn(1, 2, 3, 4)
    controller = StubController()
    with serving(controller):
        fn(q)
        with PassThrough():
            fn(q)
        for shift in (1.0, 2.0, 3.0):
            controller.step = StepObject(shift)  # a new object per step, as the serving engine's StepState
            torch.testing.assert_close(fn(q), (q * 0.5 + shift).transpose(1, 2) + 1)
    assert controller.traced == 0 and graphs.frame_count == 1
