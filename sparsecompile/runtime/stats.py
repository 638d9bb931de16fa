"""KV statistics: resident tokens and bytes per layer, pages allocated and free, method metadata bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache_manager import CacheManager


@dataclass
class LayerStats:
    layer: int
    resident_tokens: int  # summed over sequences and KV heads
    resident_bytes: int  # K/V bytes: resident_tokens x head_dim x 2 x dtype size, or KIVI's codes, scales, residual
    allocated_pages: int
    tokens_read: int | None = None  # slots the last decode step read (dynamic-selection methods)


@dataclass
class KVStats:
    method: str
    page_size: int
    total_pages: int
    free_pages: int
    layers: list[LayerStats] = field(default_factory=list)
    metadata_bytes: int = 0  # method metadata (scores, page summaries) of the pages in use

    @property
    def resident_tokens(self) -> int:
        return sum(s.resident_tokens for s in self.layers)

    @property
    def resident_bytes(self) -> int:
        return sum(s.resident_bytes for s in self.layers)

    @property
    def allocated_pages(self) -> int:
        return sum(s.allocated_pages for s in self.layers)

    def summary(self) -> str:
        mib = self.resident_bytes / 2**20
        tokens = [s.resident_tokens for s in self.layers]
        lines = [f"KV cache ({self.method}): {self.resident_tokens} resident token-heads, {mib:.2f} MiB of K/V "
                 f"(+{self.metadata_bytes / 2**20:.2f} MiB method metadata)",
                 f"  pages: {self.allocated_pages} allocated, {self.free_pages} free of {self.total_pages} "
                 f"({self.page_size} tokens each)",
                 f"  per layer resident token-heads: min {min(tokens, default=0)}, max {max(tokens, default=0)}"]
        read = [s.tokens_read for s in self.layers if s.tokens_read is not None]
        if read:
            lines.append(f"  tokens read per decode step (all layers): {sum(read)} of {self.resident_tokens} resident")
        return "\n".join(lines)


def collect(manager: CacheManager, rows: list[int], method: str, tokens_read: dict[int, int] | None = None) -> KVStats:
    """Statistics of ``rows`` (host sync: for reporting, not for hot paths)."""
    layout = manager.layout
    stats = KVStats(method, layout.page_size, manager.num_pages, manager.allocator.num_free)
    pages_in_use = 0
    for layer in range(layout.num_layers):
        tokens = sum(sum(manager.resident_tokens(row, layer)) for row in rows)
        pages = sum(len(manager.pages_of(row, layer)) for row in rows)
        pages_in_use += pages
        read = None if tokens_read is None else tokens_read.get(layer)
        kv_bytes = sum(manager.resident_bytes(row, layer) for row in rows)  # the storage format's exact bytes
        stats.layers.append(LayerStats(layer, tokens, kv_bytes, pages, read))
    per_page = sum(t[0].numel() * t.element_size() for t in (*manager.slot_metadata.values(),
                                                            *manager.page_metadata.values()))
    stats.metadata_bytes = pages_in_use * per_page
    return stats
