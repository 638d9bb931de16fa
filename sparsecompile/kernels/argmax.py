"""``first_argmax``: ``torch.argmax(x, -1)`` over a vocabulary-wide last dimension, as two reductions on CUDA.

Greedy decoding takes the argmax of ``[batch, vocab]`` logits every step. On the H200 torch's argmax over 128,256
entries runs one block per row: 35 us a step at batch 1, 4 and 16 (``aten::argmax`` in every decode profile, e.g.
``results/profile_vanilla_32k_b1_gemm_tune0.txt``), about as long as a layer's attention at 32K. Split into
``CHUNKS`` chunks, the per-chunk maxima are one wide reduction over ``batch x CHUNKS`` rows and the argmax of the
chunk maxima a small one. The result is exactly ``torch.argmax``'s, ties and NaNs included: ``torch.max(dim)`` and
``torch.argmax`` both return the first index of the maximum (NaN counting as the largest value), so the first chunk
holding the maximum, and the first index inside it, is the first index overall.
"""

from __future__ import annotations

import torch

CHUNKS = 128  # divides the vocabularies of Llama 3 (128,256), Qwen 2.5 (151,936), Mistral (32,768), SmolLM2 (49,152)
SPLIT_FROM = 16384  # narrower rows: one reduction is as fast


def first_argmax(x: torch.Tensor, split: bool | None = None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (``x [..., vocab]`` -> int64 ``[...]``). ``split``: the two-reduction form
    (None: on CUDA when the vocabulary is at least ``SPLIT_FROM`` wide and a multiple of ``CHUNKS``; tests force
    it on CPU)."""
    vocab = x.shape[-1]
    if split is None:
        split = x.is_cuda and vocab >= SPLIT_FROM
    if not split or vocab % CHUNKS or x.numel() == 0:
        return x.argmax(dim=-1)
    width = vocab // CHUNKS
    values, inner = x.reshape(*x.shape[:-1], CHUNKS, width).max(dim=-1)
    chunk = values.argmax(dim=-1, keepdim=True)
    return (chunk * width + inner.gather(-1, chunk)).squeeze(-1)
