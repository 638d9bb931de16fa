"""CUDA-only (skipped without a GPU): ``first_argmax``'s two reductions against ``torch.argmax`` at Llama 3's
vocabulary, on logits cast from bf16 (exact ties among the largest values are common there), NaN and ``-inf`` rows."""

from __future__ import annotations

import pytest
import torch

from sparsecompile.kernels.argmax import first_argmax

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_first_argmax_equals_torch_argmax_on_cuda(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    for trial in range(20):
        x = torch.randn(batch, 128256, device="cuda", generator=g).to(torch.bfloat16).float()
        x[:, torch.randint(0, 128256, (8,), device="cuda", generator=g)] = x.max() + 1  # tied maxima, eight places
        if trial % 4 == 1:
            x[0, torch.randint(0, 128256, (3,), device="cuda", generator=g)] = float("nan")
        if trial % 4 == 2:
            x[-1] = float("-inf")
        assert torch.equal(first_argmax(x), x.argmax(-1)), trial
