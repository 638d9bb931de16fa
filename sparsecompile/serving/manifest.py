"""The manifest of an exported artifact: what it holds, what it was built with, and the checks before loading.

``manifest.json`` (written by ``sparsecompile.export``, read by ``sparsecompile.load``)::

    format, format_version      "sparsecompile-artifact", 1
    form                        "aoti" (AOTInductor .pt2 packages) or "exported" (torch.export programs, run
                                eagerly or warm-compiled from the shipped compile cache: the fallback form)
    versions                    torch, triton, transformers, sparsecompile, python of the exporting process
    device                      {"type": "cuda", "arch": "sm_90", "name": ...} or {"type": "cpu"}
    model                       ModelInfo fields, dtype, vocab_size, eos_token_ids, name
    method                      {"name", "options"}: the method and its options as given
    engine, serving             EngineConfig / ServingConfig fields the artifact was built for
    programs                    {"prefill": {...}, "decode": {...}}: file, inputs, state slot names, batch range
    weights                     {"file", "aliases"}: one safetensors file; aliases map tied names to stored ones
    tokenizer, tokenizer_class  the tokenizer's directory, and its class as "module:name" (loaded directly:
                                ``transformers.AutoTokenizer`` imports far more than a tokenizer needs)
    buckets                     decode batch sizes captured as CUDA graphs at load
    kernels                     (CUDA) the directory of sparsecompile's own Triton kernels, compiled by a trial load at
                                export and copied into the loading process's Triton cache (``artifact_kernels.py``)
    files                       {relative path: sha256} of every package, program, config and tokenizer file
    fingerprint                 sha256 over ``files``, the weights file's safetensors header and the config sections
    export_seconds              where the export's time went, per phase (informational, not fingerprinted)

:func:`check` refuses, with the reason, a manifest of another format, torch version or GPU architecture, and an
artifact whose files no longer match their hashes (the weights' values are covered by their size and header only:
hashing 16 GB would cost more than the whole load).
"""

from __future__ import annotations

import hashlib
import json
import platform
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from ..models.default_model import sha256_of

FORMAT = "sparsecompile-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FORMS = ("aoti", "exported")
#: sections covered by the fingerprint besides the files (what the loader builds the KV core from)
_FINGERPRINTED = ("format_version", "form", "versions", "device", "model", "method", "engine", "serving", "programs",
                  "weights", "buckets")


class ArtifactError(RuntimeError):
    """An artifact cannot be loaded here; the message says why and what to do."""


def safetensors_header_digest(path: Path) -> str:
    """sha256 of a safetensors file's header (names, dtypes, shapes, offsets) and its size: cheap, and any change
    of layout or length shows."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ArtifactError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        header = handle.read(length)
    return hashlib.sha256(header + str(path.stat().st_size).encode()).hexdigest()


def versions() -> dict[str, str | None]:
    package = sys.modules[__name__.split(".")[0]]  # the package itself (importing it by name breaks the floors)
    found: dict[str, str | None] = {"torch": torch.__version__, "sparsecompile": package.__version__,
                                    "python": platform.python_version()}
    for name in ("triton", "transformers"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    return found


def device_facts(device: torch.device) -> dict[str, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return {"type": device.type}
    major, minor = torch.cuda.get_device_capability(device)
    return {"type": "cuda", "arch": f"sm_{major}{minor}", "name": torch.cuda.get_device_name(device)}


def fingerprint(manifest: dict[str, Any], root: Path) -> str:
    """sha256 over the listed files' hashes, the weights header and the fingerprinted config sections."""
    digest = hashlib.sha256()
    for name, sha in sorted(manifest["files"].items()):
        digest.update(f"{name}\0{sha}\n".encode())
    digest.update(safetensors_header_digest(root / manifest["weights"]["file"]).encode())
    sections = {key: manifest.get(key) for key in _FINGERPRINTED}
    if "tokenizer_class" in manifest:  # absent from artifacts exported before it was recorded (their hash stays)
        sections["tokenizer_class"] = manifest["tokenizer_class"]
    digest.update(json.dumps(sections, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def hash_files(root: Path, names: list[str]) -> dict[str, str]:
    return {name: sha256_of(root / name) for name in sorted(names)}


def write(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Complete ``manifest`` (format, versions, fingerprint) and write it to ``root/manifest.json``."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions(), **manifest}
    manifest["fingerprint"] = fingerprint(manifest, root)
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=str) + "\n")
    return manifest


def read(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{root} holds no {MANIFEST}: not a sparsecompile artifact (make one with "
                            "`sparsecompile export`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ArtifactError(f"{path} is not valid JSON ({err}); the artifact is damaged, export it again") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a sparsecompile artifact manifest (format {manifest.get('format')!r})")
    return manifest


def check(manifest: dict[str, Any], root: Path, device: torch.device, *, verify_files: bool = True) -> None:
    """Refuse an artifact this process cannot run faithfully (see module docstring)."""
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {manifest.get('format_version')} is not supported by this "
                            f"sparsecompile (reads version {FORMAT_VERSION}); export it again with this version")
    if manifest.get("form") not in FORMS:
        raise ArtifactError(f"unknown artifact form {manifest.get('form')!r} (expected one of {FORMS})")
    built = manifest.get("versions", {}).get("torch")
    if built != torch.__version__:
        raise ArtifactError(f"the artifact was built with torch {built} but this process runs torch "
                            f"{torch.__version__}; compiled programs only load into the torch that built them: "
                            "export it again here, or install that torch")
    want = manifest.get("device", {})
    have = device_facts(device)
    if want.get("type") != have["type"]:
        raise ArtifactError(f"the artifact was built for {want.get('type')} but the loading device is {have['type']}; "
                            f"load it with device={want.get('type')!r} or export it again for {have['type']}")
    if want.get("type") == "cuda" and want.get("arch") != have.get("arch"):
        raise ArtifactError(f"the artifact's kernels were built for {want.get('arch')} ({want.get('name')}) but this "
                            f"GPU is {have.get('arch')} ({have.get('name')}); export it again on this GPU")
    if not verify_files:
        return
    for name, sha in sorted(manifest.get("files", {}).items()):
        path = root / name
        if not path.exists():
            raise ArtifactError(f"the artifact lacks {name}, which its manifest lists; copy the whole directory")
        got = sha256_of(path)
        if got != sha:
            raise ArtifactError(f"{name} does not match the manifest (sha256 {got[:16]}..., expected {sha[:16]}...): "
                                "the artifact was modified after export; export it again")
    expected = fingerprint(manifest, root)
    if manifest.get("fingerprint") != expected:
        raise ArtifactError("the manifest's fingerprint does not match its contents (the manifest or the weights "
                            "header was modified after export); export it again")
