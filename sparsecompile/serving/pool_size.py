"""How many KV pages the serving engine's pool gets: the memory budget (vLLM's ``kv_cache_memory`` /
``gpu_memory_utilization`` meanings) less the rows' own bytes, divided by a page's bytes, capped by what the
engine's requests could ever use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import ServingConfig

if TYPE_CHECKING:
    from ..runtime.controller import SparseController

CPU_KV_MEMORY = 1 << 30  # default KV pool on CPU when kv_cache_memory is not given
GPU_KV_FRACTION = 0.85  # of the memory free after loading, when kv_cache_memory is not given


def kv_budget_bytes(config: ServingConfig, device: torch.device) -> int:
    """Bytes the KV pool may take: ``kv_cache_memory`` (bytes, or a fraction of the free GPU memory), or
    ``gpu_memory_utilization`` (vLLM's meaning: the process's share of the GPU's total memory, weights and
    activations included), or the default (0.85 of free GPU memory; 1 GiB on CPU)."""
    cuda = torch.device(device).type == "cuda"
    mem, util = config.kv_cache_memory, config.gpu_memory_utilization
    if util is not None:
        if not cuda:
            raise ValueError("gpu_memory_utilization needs a CUDA device; pass kv_cache_memory in bytes on CPU")
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * util) - (total - free)
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV pool: the process already "
                             f"uses {(total - free) / 2**30:.1f} GiB of {total / 2**30:.1f} GiB; raise it")
        return budget
    if mem is None:
        return int(torch.cuda.mem_get_info(device)[0] * GPU_KV_FRACTION) if cuda else CPU_KV_MEMORY
    if 0 < mem <= 1:
        if not cuda:
            raise ValueError("kv_cache_memory as a fraction needs a CUDA device; pass bytes on CPU")
        return int(torch.cuda.mem_get_info(device)[0] * mem)
    return int(mem)


def pages_from_memory(controller: SparseController, budget: int, max_model_len: int, max_num_seqs: int,
                      rows: int) -> int:
    """Pages that fit ``budget`` bytes once ``rows`` rows' own bytes are paid (KIVI's residual rings) and the room the
    oracle keeps for prompt buffers outside the pool (its ``buffer_budget``), capped by what ``max_num_seqs`` requests
    of ``max_model_len`` tokens could use; refused when not one token fits."""
    c = controller
    probe = c.build_pool(1, 1, 1)  # registers the method's metadata, so its bytes count per page
    per_page = probe.bytes_per_page
    left = budget - rows * probe.bytes_per_row - c.oracle.buffer_budget
    useful = max_num_seqs * c.oracle.pages_for(c.oracle.peak_slots_per_layer(max_model_len, 0))
    pages = min(left // per_page, useful)
    if pages < c.layout.num_layers:
        buffers = f" and {c.oracle.buffer_budget} bytes of prompt buffers" if c.oracle.buffer_budget else ""
        raise ValueError(f"kv_cache_memory={budget} bytes holds {max(left, 0) // per_page} pages of {per_page} bytes "
                         f"after {rows} rows of {probe.bytes_per_row} bytes{buffers}; one token needs "
                         f"{c.layout.num_layers} (one per layer): give the engine more memory (or a shorter "
                         "max_model_len)")
    return pages
