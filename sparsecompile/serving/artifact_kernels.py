"""What a fresh loading process would compile, compiled at export by a child process and shipped in the artifact:
the Triton kernels of sparsecompile's own ops (CUDA) and the fallback form's inductor compile cache.

An AOTInductor package embeds inductor's kernels as cubins, but sparsecompile's ops (``kv_write``,
``paged_attention``, Quest's page scores, ``topk_select``, ...) are ``torch.library`` ops that launch Triton
kernels through Triton's JIT: the package calls them back through its proxy executor. In a process whose Triton
cache lacks those kernels, the first steps compile them. The load phase that captures the decode CUDA graphs took
3.7-5.4 s of an 8.9-10.5 s load-to-first-token on the H200 (8B shape, snapkv and quest) and 0.7-9.3 s in the
2-layer GPU tests, depending on whether earlier tests had warmed the Triton cache: most of it is likely those
compiles.

So ``export`` loads the fresh artifact once in a child process whose Triton cache is the artifact's ``kernels/``
directory (a trial load, decode graphs captured, one short prompt generated: it also proves the artifact loads),
and ships what Triton wrote there. ``load`` copies each entry missing from this process's Triton cache into it
before the first step, re-pointing Triton's group files (they name their members by absolute path). Entries are
named by Triton's own cache key (source, compile options, target, Triton version), so a copied entry is used
exactly where this process would have compiled the same kernel, and never otherwise; the manifest's file hashes
cover the shipped files like every other one.

The fallback form (``torch.export`` programs compiled at load) ships the compiler's cache artifacts
(``torch.compiler.save_cache_artifacts``) of its decode program, and they too come from a child process that
loads the artifact with empty compile caches and compiles every batch bucket: inductor's cache key covers the
traced graph, whose node names follow counters of the process that traced it, so a compile in the exporting
process (which may have compiled other graphs before) missed in a fresh loading process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .manifest import ArtifactError

KERNELS = "kernels"
#: KV memory of the trial load (its kernels do not depend on the pool's size; the default takes most of the GPU)
TRIAL_KV_BYTES = 1 << 30
_TRIAL = r"""
import json, sys
import sparsecompile
llm = sparsecompile.load(sys.argv[1], kv_cache_memory=int(sys.argv[2]))
prompt = list(range(3, 3 + int(sys.argv[3])))
llm.generate([prompt, prompt[:-5]], sparsecompile.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
"""


_COMPILE = r"""
import sys
import torch
import sparsecompile
llm = sparsecompile.load(sys.argv[1], kv_cache_memory=int(sys.argv[2]))  # compiles batch 1 (the load's warm-up)
engine = llm.llm_engine
engine.controller._compiled_decode.padding_steps(engine.graph_sizes)  # and every other bucket
saved = torch.compiler.save_cache_artifacts()
if saved is None:
    sys.exit("torch.compiler.save_cache_artifacts returned nothing after compiling the decode program")
open(sys.argv[3], "wb").write(saved[0])
"""


def _child(script: str, args: list[str], env: dict[str, str], timeout: float, what: str) -> None:
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if done.returncode != 0:
        raise ArtifactError(f"{what} failed:\n{done.stderr[-3000:]}")


def compile_decode_cache(root: Path, file: str, timeout: float = 900) -> None:
    """Compile the fallback form's decode program at every batch bucket in a child process that loads the artifact
    in ``root`` with empty compile caches, and write its cache artifacts to ``root/file``."""
    with tempfile.TemporaryDirectory(prefix="sc-compile-") as cold:
        env = {name: str(Path(cold) / name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        _child(_COMPILE, [str(root), str(TRIAL_KV_BYTES), str(root / file)], env, timeout,
               "compiling the exported decode program in a fresh process")


def triton_cache_dir() -> Path:
    """This process's Triton cache directory (``TRITON_CACHE_DIR``, else Triton's default)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # an older Triton without knobs
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def compile_kernels(root: Path, prompt_tokens: int = 40, timeout: float = 900) -> list[str]:
    """Trial-load the artifact in ``root`` in a child process with ``root/kernels`` as its Triton cache; returns
    the files written there (relative to ``root``). A failing trial load fails the export with its error."""
    target = root / KERNELS
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir()
    _child(_TRIAL, [str(root), str(TRIAL_KV_BYTES), str(prompt_tokens)], {"TRITON_CACHE_DIR": str(target)}, timeout,
           "the trial load of the exported artifact")
    for stray in [p for p in target.rglob("*") if p.name == "lock" or p.name.startswith("tmp.")]:
        shutil.rmtree(stray) if stray.is_dir() else stray.unlink()
    return sorted(str(p.relative_to(root)) for p in target.rglob("*") if p.is_file())


def _repoint_groups(entry: Path, final: Path) -> None:
    """Triton's group files (``__grp__<name>.json``) list their members by absolute path, and Triton treats a group
    whose members do not exist as a miss: point them at the entry's final directory in this cache."""
    for group in entry.glob("__grp__*.json"):
        data = json.loads(group.read_text())
        members = data.get("child_paths")
        if isinstance(members, dict):
            data["child_paths"] = {name: str(final / Path(path).name) for name, path in members.items()}
            group.write_text(json.dumps(data))


def install_kernels(root: Path, manifest: dict) -> int:
    """Copy the artifact's shipped kernel entries missing from this process's Triton cache into it (each through
    a temporary directory and one rename, so a concurrent process never sees half an entry); returns how many."""
    if not manifest.get("kernels"):
        return 0
    source = root / manifest["kernels"]
    if not source.is_dir():
        raise ArtifactError(f"the manifest lists shipped kernels in {manifest['kernels']}/, which is missing")
    cache = triton_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    copied = 0
    for entry in sorted(p for p in source.iterdir() if p.is_dir()):
        if (cache / entry.name).exists():
            continue
        staging = Path(tempfile.mkdtemp(prefix=f"tmp.{entry.name[:16]}.", dir=cache))
        try:
            shutil.copytree(entry, staging, dirs_exist_ok=True)
            _repoint_groups(staging, cache / entry.name)
            os.replace(staging, cache / entry.name)
            copied += 1
        except OSError:  # another process installed it first: theirs is the same entry
            shutil.rmtree(staging, ignore_errors=True)
    return copied

