"""Prefill-step inputs for ``sparsecompile::paged_prefill_attention`` as the engine lays them out (tests and
benchmarks/prefill_attention.py): per row, ``prefix`` resident slots of older tokens, then the step's ``new``
tokens in the last slots in position order, left-padded queries, a page view whose index is shared by every KV
head. Optionally per-head evicted prefixes (random older positions in random slot order) and empty holes."""

from __future__ import annotations

import torch


def prefill_case(prefix: list[int], new: list[int], *, kv_heads: int = 2, group: int = 4, head_dim: int = 16,
                 page: int = 4, queries: int | None = None, evict: bool = False, holes: float = 0.0, window: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
                 extra_entries: int = 1) -> dict:
    """Keyword arguments of the op (``block_size = page``) for ``len(prefix)`` rows.

    ``evict``: each KV head keeps its own random subset of older positions (out of ``2 * prefix + 3``), in random
    slot order; ``holes``: fraction of prefix slots left empty (position -1). Slots outside the view and past
    ``lengths`` hold small garbage positions, so reading them would show.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)  # built on the device: benchmark pools are gigabytes
    batch = len(prefix)
    queries = queries or max(new)
    lengths = [p + n for p, n in zip(prefix, new)]
    pages = [-(-n // page) for n in lengths]
    entries = max(pages) + extra_entries
    num_pages = sum(pages) + 3
    perm = torch.randperm(num_pages, generator=g, device=dev)
    index = torch.randint(0, num_pages, (batch, entries), generator=g, device=dev)  # stale past the used pages
    start = 0
    for b, n in enumerate(pages):
        index[b, :n] = perm[start:start + n]
        start += n
    shape = (num_pages, kv_heads, page, head_dim)
    k_pool = torch.randn(shape, generator=g, device=dev, dtype=dtype)
    v_pool = torch.randn(shape, generator=g, device=dev, dtype=dtype)
    pos_pool = torch.randint(0, 8, shape[:3], generator=g, dtype=torch.int32, device=dev)
    q_positions = torch.full((batch, queries), -1, dtype=torch.int64, device=dev)
    for b in range(batch):
        slot = torch.arange(lengths[b], device=dev)
        page_of, offset = index[b, slot // page], slot % page
        span = 2 * prefix[b] + 3 if evict else prefix[b]
        for h in range(kv_heads):
            if evict:
                older = torch.randperm(span, generator=g, device=dev)[: prefix[b]]
            else:
                older = torch.arange(prefix[b], device=dev)
            if holes:
                older = torch.where(torch.rand(prefix[b], generator=g, device=dev) < holes, -1, older)
            pos = torch.cat([older, span + torch.arange(new[b], device=dev)]).to(torch.int32)
            pos_pool[page_of, h, offset] = pos
        q_positions[b, queries - new[b]:] = span + torch.arange(new[b], device=dev)
    query = torch.randn(batch, queries, kv_heads * group, head_dim, generator=g, device=dev, dtype=dtype)
    return dict(query=query.transpose(1, 2), k_pool=k_pool, v_pool=v_pool, pos_pool=pos_pool,
                index=index[:, None, :].expand(-1, kv_heads, -1).to(torch.int32),
                lengths=torch.tensor(lengths, dtype=torch.int32, device=dev)[:, None].expand(-1, kv_heads),
                q_positions=q_positions, num_new=torch.tensor(new, dtype=torch.int64, device=dev),
                block_size=page, scale=head_dim ** -0.5, sliding_window=window)


def slot_view(case: dict) -> dict:
    """The same resident slots as a slot-list view (``block_size = 1``), each head listing them in reverse."""
    page = case["block_size"]
    index, lengths = case["index"], case["lengths"]
    width = index.shape[-1] * page
    j = torch.arange(width, device=index.device)
    slots = index.long().repeat_interleave(page, dim=-1) * page + j % page
    n = lengths.long()[..., None]
    order = torch.where(j < n, n - 1 - j, j)  # reversed within the list: the kernel must not assume order
    return {**case, "index": torch.gather(slots, 2, order).to(torch.int32), "block_size": 1}
