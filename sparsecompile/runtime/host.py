"""Host -> device transfers that do not block the host (used by the CacheManager and the method runtimes).

``torch.as_tensor(array, device="cuda")``, ``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` of a
pageable CPU tensor each end in ``cudaStreamSynchronize``: the host waits for every kernel already queued,
and the GPU then idles while Python queues the next ones. In a per-layer loop that serialises host and
device. :func:`to_device` stages the values in pinned memory instead and copies without blocking.

Pinning has its own price: a buffer of a size class the caching host allocator has not seen yet is a new
page-locked allocation. In the H200 trace of a first 32K prompt (``gpu_gaps_vanilla_32768_h200b.txt``) two
``pin_memory`` calls (0.26, then 2 MiB) took 17 and 14 ms: 31 of the 54 ms the GPU idled. So when the stream
has nothing queued (``cudaStreamQuery``, which does not block) the values go by a plain copy: its
synchronisation returns at once, and the GPU had nothing to do anyway.

This module imports nothing from sparsecompile, so runtime and methods can both use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence, device: torch.device | str) -> torch.Tensor:
    """Host values (a numpy array or a nested list of numbers) -> a tensor on ``device``, without a host sync.

    On CUDA the values are copied into a pinned buffer of the caching host allocator, then to the device with
    ``non_blocking=True``; the buffer is reused only once that copy has run, so ``values`` may change right after.
    The dtype is numpy's (a list of Python ints gives int64). On other devices the result may share memory with
    a contiguous numpy ``values``.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    device = torch.device(device)
    if device.type != "cuda" or _stream_idle(device):
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _stream_idle(device: torch.device) -> bool:
    """Has the current stream of ``device`` run everything queued on it? (Never while it captures a graph, and
    never under ``torch.cuda.set_sync_debug_mode``: that mode looks for copies that wait, and this one would.)"""
    if torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0:
        return False
    return torch.cuda.current_stream(device).query()
