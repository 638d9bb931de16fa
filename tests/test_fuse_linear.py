"""Sibling projections (q/k/v, gate/up) share one buffer and run as one GEMM in the compiled decode graph."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair
from torch import nn
from torch._dynamo.utils import counters

import sparsecompile
from sparsecompile.models.colocate import colocate_projections, separate_projections
from sparsecompile.models.hf_patch import patched_model
from sparsecompile.passes.fuse_linear import fuse_sibling_linears


class _Block(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(16, 32, bias), nn.Linear(16, 8, bias), nn.Linear(16, 8, bias)
        self.gate_proj, self.up_proj = nn.Linear(16, 24, bias=False), nn.Linear(16, 24, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(*x.shape[:-1], 4, 8) * 2).sum(-2) + k + v * 3 + (self.gate_proj(x) * self.up_proj(x))[..., :8]


def _compile_counting(module):
    seen = []

    def backend(gm, example_inputs):
        seen.append(fuse_sibling_linears(gm, example_inputs))
        # every computed node keeps its example value (with or without bias): a node without one makes AOTAutograd's
        # cache bypass the whole graph, and a new process then pays the full AOT compile again
        assert [n.name for n in gm.graph.nodes if n.op.startswith("call") and "example_value" not in n.meta] == []
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(module, backend=backend, fullgraph=True), seen


def _storages(module):
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


@pytest.mark.parametrize("bias", [False, True])
def test_colocated_siblings_fuse_and_compute_the_same(bias):
    torch.manual_seed(0)
    block = _Block(bias).eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        want = block(x)
        params = len(list(block.parameters()))
        assert colocate_projections(block) == 2
        assert len(_storages(block)) == (2 if bias else 1) + 1  # q/k/v weights (+ biases), gate/up weights
        compiled, seen = _compile_counting(block)
        # one GEMM of 48 output rows instead of 32 + 8 + 8: the same products, blocked differently
        torch.testing.assert_close(compiled(x), want, atol=1e-5, rtol=1e-5)
    assert seen == [2]
    separate_projections(block)
    assert len(_storages(block)) == params
    with torch.no_grad():
        assert torch.equal(block(x), want)


def test_siblings_in_separate_buffers_are_left_alone():
    block = _Block(False).eval()
    compiled, seen = _compile_counting(block)
    with torch.no_grad():
        compiled(torch.randn(2, 16))
    assert seen == [0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: biased q/k/v
def test_compiled_decode_fuses_every_layer_and_restore_separates(model_type):
    torch._dynamo.reset()
    reference, model = tiny_pair(model_type, seed=3, num_hidden_layers=2)
    sparsecompile.optimize(model, "vanilla", page_size=4, compile=True)
    ids = torch.randint(3, 96, (2, 9))
    want = reference.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    bypassed = counters["aot_autograd"]["autograd_cache_bypass"]
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
    assert counters["aot_autograd"]["autograd_cache_bypass"] == bypassed  # the fused graph is cacheable on disk
    backend = patched_model(model).controller.decode_backend
    assert backend.fused_groups == 2 * 2  # q/k/v and gate/up in each of 2 layers
    sparsecompile.restore(model)
    assert len(_storages(model)) == len(list(model.parameters()))
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
