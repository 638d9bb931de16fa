"""CUDA-only checks of the fused pointwise ops (skipped without a GPU): ``rms_norm`` and ``silu_mul`` against their
torch references at the Llama-3.1-8B shape, and a bf16 prefill with them against one without.

Tolerances: both kernels compute in fp32 and round where the unfused ops round; only the mean's summation order
(rms_norm) and ``exp`` (silu) differ, so an output may differ by one bf16 ulp of its normalised value: 1e-2
relative, and at most 1 % of the elements differing at all.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_and_silu_mul_at_the_8b_shape(dtype):
    from sparsecompile.kernels.fused_pointwise import rms_norm, rms_norm_reference, silu_mul, silu_mul_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 4099, 4096, generator=g, device="cuda") * 4).to(dtype)
    weight = torch.randn(4096, generator=g, device="cuda").to(dtype)
    _close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))
    head = torch.randn(3, 8, 77, 128, generator=g, device="cuda").to(dtype)  # Qwen3's per-head q / k norms
    _close(rms_norm(head, weight[:128], 1e-6), rms_norm_reference(head, weight[:128], 1e-6))
    gate = (torch.randn(4099, 14336, generator=g, device="cuda") * 3).to(dtype)
    up = torch.randn(4099, 14336, generator=g, device="cuda").to(dtype)
    _close(silu_mul(gate, up), silu_mul_reference(gate, up))


def test_bf16_prefill_with_fused_pointwise_equals_unfused():
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    import sparsecompile

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=3)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda", torch.bfloat16).eval()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to("cuda", torch.bfloat16).eval()
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 300), device="cuda")
    options = dict(page_size=16, prefill_chunk_size=0, prefill_mlp_chunk=256, compile=False)
    with sparsecompile.patched(reference, "vanilla", fuse_pointwise=False, **options), torch.no_grad():
        want = reference(input_ids=ids).logits
    sparsecompile.optimize(model, "vanilla", **options)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95
