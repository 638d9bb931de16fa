"""The method test matrix: one row per method, with options that make it keep everything
(budget >= sequence length), so it must equal the unpatched model token for token."""

from __future__ import annotations

# method name -> options under which the method must be exactly dense on the tiny-model tests
DENSE_EQUIVALENT = {
    "vanilla": {},
    # tiny models have 2 layers: make every layer sparse (quest) / observe at layer 0, read with layer 1 (omnikv)
    "quest": {"budget": 1024, "dense_layers": 0, "dense_below": 0},
    "omnikv": {"budget": 1024, "filter_layers": "0", "dense_below": 0},
    # eviction methods: a budget above prompt + generated tokens (11 + 16) never evicts
    "streamingllm": {"budget": 64},
    "snapkv": {"budget": 64},
    "pyramidkv": {"budget": 64},
    "h2o": {"budget": 64},
    "kvzip": {"budget": 64},
    # KIVI storage: a residual longer than every sequence keeps all tokens in full precision (the quantized paths are
    # checked against independent formulas in tests/test_kivi.py); head_dim 16 needs groups of at most 16
    "kivi": {"residual": 64, "group_size": 16},
    "snapkv+kivi": {"budget": 64, "residual": 64, "group_size": 16},
    # the window's floor is its pinned page plus the residual (16 + 64)
    "streamingllm+kivi": {"budget": 80, "residual": 64, "group_size": 16},
    "kvzip+kivi": {"budget": 64, "residual": 64, "group_size": 16},
    # the group eviction's floor is the residual plus one group (64 + 16)
    "h2o+kivi": {"budget": 80, "residual": 64, "group_size": 16},
    "quest+kivi": {"budget": 1024, "dense_layers": 0, "dense_below": 0, "residual": 64, "group_size": 16},
}

# method name -> options under which the method drops or quantizes at the tiny-model tests' lengths (prompts of
# 20-40 tokens, prefill chunks of 8): results differ from dense, but a row's must not depend on the rest of its batch
COMPRESSING = {
    "vanilla": {},
    "quest": {"budget": 8, "dense_layers": 0, "dense_below": 0},
    "omnikv": {"budget": 8, "filter_layers": "0", "dense_below": 0},
    "streamingllm": {"budget": 12, "sinks": 2},
    "snapkv": {"budget": 12, "window": 4},
    "pyramidkv": {"budget": 12, "window": 4},
    "h2o": {"budget": 12, "recent": 4},
    "kvzip": {"budget": 12},
    "kivi": {"bits": 2, "residual": 8, "group_size": 4},
    "snapkv+kivi": {"budget": 16, "window": 2, "bits": 2, "residual": 8, "group_size": 4},
    "pyramidkv+kivi": {"budget": 16, "window": 2, "bits": 2, "residual": 8, "group_size": 4},
    "streamingllm+kivi": {"budget": 16, "sinks": 1, "bits": 2, "residual": 8, "group_size": 4},
    "h2o+kivi": {"budget": 16, "recent": 4, "bits": 2, "residual": 8, "group_size": 4},
    "kvzip+kivi": {"budget": 16, "bits": 2, "residual": 8, "group_size": 4},
    # the residual, the boundary page and one page of 16 (pages hold whole groups: max(page_size, group_size))
    "quest+kivi": {"budget": 28, "dense_layers": 0, "dense_below": 0, "bits": 2, "residual": 8, "group_size": 4},
}
