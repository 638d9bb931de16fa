"""SparseCache: the transformers ``Cache`` that ``generate()`` carries between steps.

It is a handle, not storage: the KV lives in the controller's CacheManager, and the cache only
records which manager rows hold this batch and how many input columns were processed (HF's notion
of sequence length, padding included). It is created lazily sized (rows are taken at the first
forward, after ``generate()`` has expanded the batch) and frees its rows when released or garbage
collected. :meth:`SparseCache.fork` (also ``copy.deepcopy``) gives an independent cache sharing the pages
copy-on-write; :meth:`SparseCache.crop` works where it is exact. Beam search and batch reordering are
refused rather than silently wrong.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _LogicalLayer(CacheLayerMixin):
    """A per-layer stub so transformers' Cache helpers work; the owner holds the only state."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: SparseCache) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # The patched forward never passes this cache into the model (K/V go to the pool through attention): only a
        # model that is not patched (any more) gets here, and its attention would read no history.
        raise RuntimeError("a SparseCache works only with the sparsecompile-patched model it came from; this model "
                           "is not patched (restore()d?): generate without the cache, or optimize() the model again "
                           "and start a new one")

    def get_seq_length(self) -> int:
        owner = self._owner()
        return owner.processed if owner is not None else 0

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1


def _release(controller_ref, rows: list[int]) -> None:
    controller = controller_ref()
    if controller is not None and rows:
        controller.release_rows(rows)
    rows.clear()


class SparseCache(Cache):
    """Handle on one batch's sequences in a patched model's CacheManager."""

    def __init__(self, controller, expected_new_tokens: int = 256) -> None:
        super().__init__(layers=[])
        self.layers = [_LogicalLayer(self) for _ in range(controller.layout.num_layers)]
        self.controller = controller
        self.rows: list[int] = []
        self.processed = 0  # input columns seen (padding included), as DynamicCache counts them
        # [batch, 1] the position the next token of each sequence takes: the last forward's positions + 1, in the
        # numbering that call used (generate() numbers by the padding mask when the model's forward takes
        # position_ids; a model whose forward does not numbers every column, padding included)
        self.next_positions: torch.Tensor | None = None
        self.prompt_pending = False  # the next forward feeds a prompt (generate()'s first), even a 1-token one
        self.expected_new_tokens = expected_new_tokens
        self._finalizer = weakref.finalize(self, _release, weakref.ref(controller), self.rows)

    # ---- sequence handling
    @property
    def is_allocated(self) -> bool:
        return bool(self.rows)

    def allocate(self, batch: int, prompt_len: int) -> list[int]:
        self.controller.reserve(batch, prompt_len, self.expected_new_tokens)
        self.rows.extend(self.controller.add_sequences(batch))
        return self.rows

    def release(self) -> None:
        """Free this batch's pages now (the cache cannot be used afterwards)."""
        _release(weakref.ref(self.controller), self.rows)
        self.processed = 0
        self.next_positions = None

    # ---- transformers Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.processed

    @property
    def is_compileable(self) -> bool:  # we compile our own decode step; HF must not compile around us
        return False

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("beam search is not supported with sparsecompile (use num_beams=1)")

    def fork(self) -> SparseCache:
        """An independent cache holding the same KV and method state (pages shared copy-on-write): generating from
        either never changes the other. "Compress once, ask many questions": ``generate(past_key_values=
        cache.fork(), ...)`` per question."""
        other = SparseCache(self.controller, self.expected_new_tokens)
        if self.rows:
            other.rows.extend(self.controller.fork_rows(self.rows))
        other.processed = self.processed
        other.next_positions = self.next_positions
        return other

    def __deepcopy__(self, memo) -> SparseCache:
        return self.fork()

    def __copy__(self) -> SparseCache:
        raise TypeError("a shallow copy would share this cache's sequences; use cache.fork() (or copy.deepcopy)")

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` input columns (negative: drop that many from the end), as
        ``DynamicCache.crop``. Exact for methods that keep every token (vanilla, quest, omnikv); eviction methods
        are refused with the reason."""
        keep = max_length if max_length >= 0 else self.processed + max_length
        if keep >= self.processed or not self.rows:
            return
        keep = max(keep, 0)
        m = self.controller.manager
        counts = m.slot_count_array(self.rows)[:, 0]
        # left padding never reaches the pool: row i holds processed - pad_i slots, so it keeps keep - pad_i
        drop = self.processed - keep
        self.controller.crop_rows(self.rows, [max(0, int(c) - drop) for c in counts])
        self.processed = keep
        self.next_positions = None  # the next forward numbers its tokens itself

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("expanding a sparsecompile cache's batch is not supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("selecting from a sparsecompile cache's batch is not supported")

    def reset(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"SparseCache(rows={self.rows}, processed={self.processed})"
