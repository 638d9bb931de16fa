"""Dense read of short batches: the ``dense`` decode variant of the selection methods (``quest``, ``omnikv``).

Selection has a fixed cost per decode step and layer (scoring pages or tokens, a top-k, the gather of the chosen
slots: launches that a short batch leaves latency-bound) and saves reading the unselected slots, so it pays only
once the batch holds enough KV. A decode step whose rows hold ``<= dense_below`` tokens in all (summed over the
batch, before the step's new tokens) runs the ``dense`` variant: every layer reads all its slots, exactly as
``vanilla`` (same kernels, same outputs); larger batches run ``sparse``. The host decides from its own slot counts
(no sync), before the method's ``prepare_step``; the device hooks read ``ctx.step.variant`` (static in a graph: a
compiled step keeps one graph per batch size and variant). The default (``dense_below=None``) reads densely while
the batch's KV per layer is at most :data:`DENSE_READ_BYTES`; ``dense_below=0`` always selects, as the methods'
references do. Since the rule sums the batch, a row's reads can depend on the rows it is batched with (serving).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..config import MethodConfigError, option

if TYPE_CHECKING:
    from ..runtime.cache_manager import CacheManager, KVLayout
    from ..runtime.contract import LayerContext
    from ..runtime.step import StepState

SPARSE, DENSE = "sparse", "dense"
#: the default threshold: the batch's KV bytes per layer (all KV heads) up to which a decode step reads densely;
#: 40,960 tokens of Llama-3.1-8B's 4 KiB per token and layer (the H200 crossovers: methods/quest.py, omnikv.py)
DENSE_READ_BYTES = 160 << 20


def dense_below_option():
    """The ``dense_below`` field of a selection method's config dataclass (one help text for every method)."""
    return option(None, "decode steps whose batch holds at most this many tokens (all rows) read densely; "
                        "None: up to 160 MiB of KV per layer; 0: always select")


def validate_dense_below(method: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise MethodConfigError(f"{method}: dense_below must be a number of tokens >= 0 (0: always select) or None "
                                f"(automatic), got {value!r}")


class DenseReadOfShortBatches:
    """Mixin of a ``SparseMethod`` whose config has ``dense_below``: the two decode variants and the host rule.
    The method calls :meth:`_set_dense_threshold` in ``setup`` and tests :meth:`dense_step` in its device hooks."""

    decode_variants: ClassVar[tuple[str, ...]] = (SPARSE, DENSE)
    dense_below: int = 0  # tokens; set from the config and the layout by _set_dense_threshold

    def _set_dense_threshold(self, dense_below: int | None, layout: KVLayout) -> None:
        if dense_below is None:
            dense_below = DENSE_READ_BYTES // (layout.num_kv_heads * layout.bytes_per_slot_head)
        self.dense_below = dense_below

    def decode_variant(self, manager: CacheManager, step: StepState) -> str:
        held = int(manager.slot_count_array(step.row_ids).max(axis=1).sum()) - sum(step.num_new_host)
        return DENSE if held <= self.dense_below else SPARSE

    @staticmethod
    def dense_step(ctx: LayerContext) -> bool:
        """Whether the traced step is the ``dense`` variant (a compile-time constant of its graph)."""
        return ctx.step.variant == DENSE
