"""``first_argmax`` (greedy decoding's argmax in two reductions) equals ``torch.argmax``: ties (first index), NaN
(the first NaN), all ``-inf`` rows, bf16, leading batch dimensions; the two-reduction form forced on CPU."""

from __future__ import annotations

import pytest
import torch

from sparsecompile.kernels.argmax import CHUNKS, first_argmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_argmax_equals_torch_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows, vocab = 1 + trial % 5, CHUNKS * (1 + trial % 37)
        x = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # few values: ties everywhere
        if trial % 3 == 0:
            x[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
        if trial % 4 == 0:
            x[0] = float("-inf")
        x[-1, -1] = 9.0 if trial % 2 else x[-1, -1]  # a maximum in the last chunk
        x = x.to(dtype)
        assert torch.equal(first_argmax(x, split=True), x.argmax(-1)), trial


def test_leading_dimensions_and_fallbacks():
    x = torch.randn(2, 3, CHUNKS * 5)
    assert torch.equal(first_argmax(x, split=True), x.argmax(-1))
    odd = torch.randn(4, CHUNKS * 5 + 1)  # not a multiple of CHUNKS: torch.argmax itself
    assert torch.equal(first_argmax(odd, split=True), odd.argmax(-1))
    assert first_argmax(torch.empty(0, CHUNKS), split=True).shape == (0,)
