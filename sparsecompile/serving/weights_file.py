"""Reading an artifact's ``weights.safetensors`` onto the serving device at disk / PCIe speed.

``safetensors.torch.load_file(path, device="cuda")`` builds one CPU tensor per weight from the memory map and copies
it with a pageable (staged, synchronous) host-to-device copy: per tensor, one read from the page cache or the disk,
then one copy, one after the other. Here the file's data section is read in large chunks by a few threads (reads
release the GIL and overlap each other, which is what a cold NVMe or a page-cache copy needs) into a ring of pinned
buffers, and each chunk is copied asynchronously on a side stream into one flat device buffer while the next chunks
are read. Every weight is then a view of that buffer (no second copy): safetensors packs the tensors back to back,
so a view is at the tensor's byte offset in the data section. A weight whose offset does not suit its dtype (or the
16-byte alignment compiled kernels assume of their pointers) is copied into an allocation of its own instead.

On a CPU device the chunks are read straight into the flat buffer (no staging).
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

#: safetensors dtype names (the format's spec) -> torch dtypes
DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
          "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
          "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
ALIGNMENT = 16  # bytes: what inductor's Triton kernels assume of a tensor's data pointer


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The tensors' entries (dtype, shape, data_offsets) by name, and the data section's start in the file."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        entries = json.loads(handle.read(length))
    entries.pop("__metadata__", None)
    for name, entry in entries.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this reader does not know")
    return entries, 8 + length


def _pread(fd: int, target: memoryview, offset: int) -> None:
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += got


def _fill_cuda(fd: int, flat: torch.Tensor, start: int, chunk: int, depth: int, pool: ThreadPoolExecutor) -> None:
    """Read the data section into ``flat`` through ``depth`` pinned buffers of ``chunk`` bytes (see module doc)."""
    total = flat.numel()
    spans = [(o, min(chunk, total - o)) for o in range(0, total, chunk)]
    size = min(chunk, total)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(depth, len(spans)))]
    views = [memoryview(b.numpy()) for b in buffers]
    copied: list[torch.cuda.Event | None] = [None] * len(buffers)
    stream = torch.cuda.Stream(flat.device)
    reads = {}

    def submit(j: int) -> None:
        b = j % len(buffers)
        if copied[b] is not None:
            copied[b].synchronize()  # the buffer's previous chunk has reached the device
        offset, size = spans[j]
        reads[j] = pool.submit(_pread, fd, views[b][:size], start + offset)

    for j in range(min(len(buffers), len(spans))):
        submit(j)
    for k, (offset, size) in enumerate(spans):
        reads.pop(k).result()
        b = k % len(buffers)
        with torch.cuda.stream(stream):
            flat[offset:offset + size].copy_(buffers[b][:size], non_blocking=True)
            copied[b] = torch.cuda.Event()
            copied[b].record(stream)
        if k + len(buffers) < len(spans):
            submit(k + len(buffers))
    stream.synchronize()


def load_safetensors(path: str | Path, device: torch.device | str, *, chunk_bytes: int = 64 << 20,
                     threads: int = 4) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` on ``device``, by name (views of one buffer, see module doc)."""
    path, device = Path(path), torch.device(device)
    entries, start = read_header(path)
    total = max((e["data_offsets"][1] for e in entries.values()), default=0)
    if os.path.getsize(path) < start + total:
        raise ValueError(f"{path} is truncated: its header describes {start + total} bytes, the file has "
                         f"{os.path.getsize(path)}")
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads) as pool:
            if device.type == "cuda":
                _fill_cuda(fd, flat, start, chunk_bytes, threads + 2, pool)
            elif total:
                view = memoryview(flat.numpy())
                list(pool.map(lambda o: _pread(fd, view[o:o + chunk_bytes], start + o), range(0, total, chunk_bytes)))
    finally:
        os.close(fd)
    out: dict[str, torch.Tensor] = {}
    for name, entry in entries.items():
        begin, end = entry["data_offsets"]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        raw = flat[begin:end]
        if begin % ALIGNMENT:  # views must keep the alignment kernels assume: an allocation of its own
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype, device=device)
    return out
