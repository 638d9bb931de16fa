"""Host -> device transfers that do not block the host (used by the CacheManager and the method runtimes).

``torch.as_tensor(array, device="cuda")``, ``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` of a
pageable CPU tensor each end in ``cudaStreamSynchronize``: the host waits for every kernel already queued,
and the GPU then idles while Python queues the next ones. In a per-layer loop that serialises host and
device. :func:`to_device` stages the values in pinned memory instead and copies without blocking.

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
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
