"""Exported artifacts (``sparsecompile.export`` / ``sparsecompile.load``) on CPU.

The artifact is exported from a 2-layer cut of the embedded SmolLM2 saved to disk (real tokenizer and chat
template, real weights). A full 30-layer SmolLM2 works the same but its AOTInductor compiles cost minutes on two
cores; the two programs of the cut cost about a minute together, once per cache (``$SPARSECOMPILE_CACHE/aoti``
keeps packages by content: the second method reuses both, see ``export_decode``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsecompile
from sparsecompile import SamplingParams
from sparsecompile.serving.manifest import ArtifactError

ENGINE = dict(max_num_seqs=4, page_size=4, prefill_chunk_size=16, max_model_len=256)
METHODS = {"vanilla": {}, "snapkv": {"budget": 24, "window": 8}}  # prompts below are longer: snapkv evicts
PROMPTS = [
    "The ocean covers most of the planet. Its currents carry heat from the equator toward the poles, and the "
    "winds above it shape the weather of every coast. Tell me what lives in the deep sea.",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen,",
    "A short poem about rain on a tin roof at night, in four lines:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "Hi",
]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow and say why the sky is blue."}]
GREEDY = SamplingParams(temperature=0, max_tokens=10)

_LOAD_SCRIPT = r"""
import json, sys
import sparsecompile
from sparsecompile import SamplingParams
llm = sparsecompile.load(sys.argv[1])
spec = json.loads(sys.argv[2])
params = SamplingParams(**spec["params"])
outs = llm.generate(spec["prompts"], params, use_tqdm=False)
chat = llm.chat(spec["chat"], params, use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "chat": chat[0].outputs[0].token_ids,
                  "modeling": sorted(m for m in sys.modules if m.startswith("transformers.models.")
                                     and ".modeling_" in m and not m.endswith(".modeling_auto")),
                  "heavy": sorted(m for m in ("sparsecompile.models.hf_patch", "transformers.generation.utils",
                                              "torch._dynamo") if m in sys.modules)}))
"""


@pytest.fixture(scope="session")
def smollm2_cut(smollm2_path, tmp_path_factory) -> Path:
    """The first two layers of the embedded SmolLM2 (fp32), saved as an HF directory with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2_cut")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, local_files_only=True)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:2]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_path, local_files_only=True).save_pretrained(out)
    return out


_STATIC_GXX = """#!/bin/sh
# g++ linking libstdc++ statically into shared objects, as the H200 image's /opt/gcc/bin/g++ does
case " $* " in *" -shared "*) exec g++ "$@" -static-libstdc++ ;; *) exec g++ "$@" ;; esac
"""


def _static_libstdcxx_compiler(root: Path) -> str | None:
    """A compiler wrapper reproducing the host where AOTI packages crashed at load (None without g++ and a static
    libstdc++ to link)."""
    if not shutil.which("g++"):
        return None
    archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive):
        return None
    wrapper = root / "g++-static-libstdc++"
    wrapper.write_text(_STATIC_GXX)
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.fixture(scope="session")
def artifacts(smollm2_cut, tmp_path_factory) -> dict[str, Path]:
    """vanilla through the Python API, snapkv through `sparsecompile export`; both compiled by a g++ that links
    libstdc++ statically into shared objects (where one exists): packages linked like that crashed at load on the
    H200 image, and export must still give packages that load (``serving/aoti_linkage.py``)."""
    import torch._inductor.config as inductor_config

    from sparsecompile.cli import main

    root = tmp_path_factory.mktemp("artifacts")
    compiler = _static_libstdcxx_compiler(root)
    with inductor_config.patch({"cpp.cxx": (None, compiler)} if compiler else {}):
        paths = {"vanilla": sparsecompile.export(str(smollm2_cut), root / "vanilla", "vanilla", **ENGINE)}
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**ENGINE, **METHODS["snapkv"]}.items()]
        assert main(["export", "--model", str(smollm2_cut), "--method", "snapkv", "--out", str(root / "snapkv"),
                     *flags]) == 0
    paths["snapkv"] = root / "snapkv"
    return paths


def _load_in_fresh_process(path: Path) -> dict:
    spec = {"prompts": PROMPTS, "chat": CHAT, "params": {"temperature": 0, "max_tokens": GREEDY.max_tokens}}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(sparsecompile.__file__).parent.parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(path), json.dumps(spec)], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_fresh_process_serves_the_artifact_token_for_token(method, artifacts, smollm2_cut):
    loaded = _load_in_fresh_process(artifacts[method])
    # transformers.AutoTokenizer imports the auto-class tables (modeling_auto), never an architecture's code
    assert loaded["modeling"] == [], "loading an artifact imported HF modeling code"
    # nor the HF glue or dynamo: seconds of imports a load does not need (the programs are compiled already)
    assert loaded["heavy"] == [], "loading an artifact imported modules it does not need"
    eager = sparsecompile.LLM(str(smollm2_cut), method, **ENGINE, **METHODS[method])
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert loaded["tokens"] == expected
    assert loaded["chat"] == eager.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    if method == "snapkv":  # the prompts are longer than the budget: the artifact's prefill evicted
        assert max(len(eager.tokenizer(p).input_ids) for p in PROMPTS) > METHODS[method]["budget"]


@pytest.mark.slow
def test_packages_link_the_shared_libstdcxx(artifacts):
    """Built by a compiler that links libstdc++ statically (the fixture), the wrappers still load the process's
    shared libstdc++: without that, loading fails (std::bad_cast on this machine, a segfault on the H200 image)."""
    from sparsecompile.serving.aoti_linkage import wrapper_libraries

    for name in ("prefill.pt2", "decode.pt2"):
        libraries = wrapper_libraries(artifacts["vanilla"] / name)
        assert libraries and all("libstdc++.so.6" in needed for needed in libraries.values()), libraries


@pytest.mark.slow
def test_the_manifest_describes_what_ships(artifacts):
    manifest = json.loads((artifacts["snapkv"] / "manifest.json").read_text())
    assert manifest["form"] == "aoti" and manifest["versions"]["torch"] == torch.__version__
    assert manifest["method"] == {"name": "snapkv", "options": METHODS["snapkv"]}
    assert set(manifest["files"]) >= {"prefill.pt2", "decode.pt2", "config.json", "tokenizer/tokenizer.json"}
    assert manifest["buckets"] == [1, 2, 4] and manifest["programs"]["decode"]["batch"] == [1, 4]
    # snapkv only appends during decode: its program takes the pool and tables, not the eviction limits
    assert manifest["programs"]["decode"]["state"] == ["manager.k_pool", "manager.v_pool", "manager.pos_pool",
                                                       "manager.block_table", "manager.lengths"]
    phases = manifest["export_seconds"]  # where the export's time went
    assert {"trace_decode", "trace_prefill", "compile_decode", "compile_prefill", "weights"} <= set(phases)
    assert all(v >= 0 for v in phases.values())


def _copy(artifact: Path, tmp_path: Path) -> Path:
    target = tmp_path / artifact.name
    shutil.copytree(artifact, target)
    return target


@pytest.mark.slow
def test_a_manifest_from_another_torch_is_refused(artifacts, tmp_path):
    path = _copy(artifacts["vanilla"], tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["versions"]["torch"] = "1.13.0"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"built with torch 1\.13\.0 but this process runs torch"):
        sparsecompile.load(path)


@pytest.mark.slow
def test_a_modified_package_or_manifest_is_refused(artifacts, tmp_path):
    path = _copy(artifacts["vanilla"], tmp_path)
    package = path / "decode.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="decode.pt2 does not match the manifest"):
        sparsecompile.load(path)
    path = _copy(artifacts["snapkv"], tmp_path / "second")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["method"]["options"]["budget"] = 4096
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="fingerprint does not match"):
        sparsecompile.load(path)


@pytest.mark.slow
def test_options_the_programs_fix_cannot_change_at_load(artifacts):
    with pytest.raises(ArtifactError, match="max_num_seqs=8 differs from the artifact's max_num_seqs=4"):
        sparsecompile.load(artifacts["vanilla"], max_num_seqs=8)
    with pytest.raises(ArtifactError, match=r"\['budget'\] cannot change at load"):
        sparsecompile.load(artifacts["snapkv"], budget=8)


_WARM_SCRIPT = r"""
import json, sys
import sparsecompile
from torch._dynamo.utils import counters
llm = sparsecompile.load(sys.argv[1])  # compiles batch 1 (the load's padding step)
out = llm.generate(json.loads(sys.argv[2]), sparsecompile.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out],
                  "counters": {k: dict(counters[k]) for k in ("aot_autograd", "inductor")}}))
"""


@pytest.mark.slow
def test_the_exported_form_starts_warm_from_its_shipped_compile_cache(tmp_path):
    """The fallback form (torch.export programs, for hosts where AOTI packages do not load) serves the eager
    engine's tokens, and with its ``compile_cache`` a fresh process with an empty cache directory compiles the decode
    program as a hit of the shipped cache artifacts only (tiny model; the form run eagerly,
    ``compile_cache=False``, is ``test_export_parts``' binding test). The cache comes from a fresh process that
    loads the artifact: compiled in the exporting process, it missed here after the earlier test files' compiles
    (inductor's key follows the traced graph's node names), and on CUDA over the model's own tensors instead of the
    weights as the loader reads them (the key covers storage offsets)."""
    from tiny_models import tiny_pair, word_tokenizer

    _, model = tiny_pair("llama")
    engine = dict(max_num_seqs=1, max_model_len=64, page_size=4, prefill_chunk_size=16, budget=12, window=4)
    path = sparsecompile.export(model, tmp_path / "warm", "snapkv", tokenizer=word_tokenizer(96), form="exported",
                                **engine)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["form"] == "exported" and "decode.ep.pt2" in manifest["files"]
    assert manifest["programs"]["decode"]["compile_cache"] in manifest["files"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (20, 9)]  # one after the other
    # every compile cache of the child empty: a load does not point inductor at $SPARSECOMPILE_CACHE, so without
    # TORCHINDUCTOR_CACHE_DIR it would use torch's /tmp/torchinductor_<user>, where earlier runs leave hits
    cold = {name: str(tmp_path / "cold" / name) for name in ("SPARSECOMPILE_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                                                              "TRITON_CACHE_DIR")}
    env = {**os.environ, **cold, "PYTHONPATH": os.pathsep.join([str(Path(sparsecompile.__file__).parent.parent),
                                                               os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _WARM_SCRIPT, str(path), json.dumps(prompts)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    # warm = no inductor compile: the graph comes from the shipped artifacts through inductor's cache (AOTAutograd's
    # misses: its key hashes the traced graph's node names, which differ between the exporting and a fresh process)
    counters = loaded["counters"]
    hits = counters["aot_autograd"].get("autograd_cache_hit", 0) + counters["inductor"].get("fxgraph_cache_hit", 0)
    assert hits >= 1 and not counters["inductor"].get("fxgraph_cache_miss"), counters
    eager = sparsecompile.LLM(model, "snapkv", tokenizer=word_tokenizer(96), compile=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=4)
    assert loaded["tokens"] == [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_an_aoti_compile_leaves_the_process_inductor_options_as_they_were(tmp_path, monkeypatch):
    """AOTInductor writes the package's device facts into ``aot_inductor.metadata`` in place: on the process-wide
    dict they joined the inductor cache key of every later graph in the process, and a later in-process load of an
    exported artifact missed its shipped compile cache (the H200's export tests, 2026-12-05). ``compile_package``
    compiles with a copy; a fresh package is built here (an empty package cache) so the compile really runs."""
    import torch._inductor.config as inductor_config

    from sparsecompile.serving.aoti_package import compile_package, inductor_configs

    monkeypatch.setenv("SPARSECOMPILE_CACHE", str(tmp_path))
    before = dict(inductor_config.aot_inductor.metadata)
    ep = torch.export.export(torch.nn.Linear(8, 8).eval(), (torch.randn(2, 8),))
    package = compile_package(ep, inductor_configs(keep_order=False), torch.device("cpu"))
    assert package.exists() and package.parent == tmp_path / "aoti"
    assert inductor_config.aot_inductor.metadata == before
