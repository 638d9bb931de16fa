"""KIVI storage under any interleaving of new prompts (chunked or whole, left-padded batches), second prompts on live
rows, decode steps over any subset of rows, forks and releases, with the pool growing on its own: after every step,
every live row's pages and residual ring hold exactly KIVI's state of its tokens (the independent formulas of
``test_kivi.py``: groups quantized up to ``Q(count)``, the rest in full precision), and pages are held exactly by
the rows that name them. K/V depend on each token's id as well as its position, so a fork that goes on with other
tokens diverges from its source: pages shared copy-on-write, a copied ring, and commits that quantize into shared
pages must leave the other row's state intact; a released row's ring is stale and must never leak into a new one."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_kivi import KV_HEADS, LAYERS, SyntheticModel, kivi_floats, kivi_state, make

MAX_POS = 120  # SyntheticModel's position tables hold 128
MAX_ROWS = 6
VOCAB = 5


class TokenModel(SyntheticModel):
    """:class:`SyntheticModel` whose K/V also add a table entry per token id."""

    def __init__(self, controller) -> None:
        super().__init__(controller)
        g = torch.Generator().manual_seed(1)
        self.token_keys = torch.randn(LAYERS, KV_HEADS, VOCAB, self.keys.shape[-1], generator=g)
        self.token_values = torch.randn(LAYERS, KV_HEADS, VOCAB, self.keys.shape[-1], generator=g)
        self.ids = None

    def kv(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[H, n, D]`` of ``tokens`` at ``positions`` (1-d)."""
        return (self.keys[layer][:, positions] + self.token_keys[layer][:, tokens],
                self.values[layer][:, positions] + self.token_values[layer][:, tokens])

    def __call__(self, input_ids=None, inputs_embeds=None, position_ids=None, logits_to_keep=0):
        pos = position_ids.clamp(min=0)
        for layer in range(LAYERS):
            q = self.queries[layer][:, pos].permute(1, 0, 2, 3)  # [B, Hq, T, D]
            k, v = (t.permute(1, 0, 2, 3) for t in self.kv(layer, input_ids, pos))
            self.controller.attend(layer, q, k, v, 0.25, 0)
        return torch.zeros(pos.shape[0], 1, 8)


class KiviMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # page 8, groups of 4, residual 8: pages hold two key groups, a prompt's end and the ring straddle pages
        controller, _ = make("kivi", bits=2, group_size=4, residual=8)
        self.controller, self.model = controller, TokenModel(controller)
        self.spec = controller.runtime.storage
        self.tokens: dict[int, list[int]] = {}  # live row -> its token ids (positions 0 .., in slot order)

    def _prefill(self, rows: list[int], prompts: list[list[int]], chunk: int | None) -> None:
        """``prompts[i]`` after each row's tokens, one left-padded batch."""
        width = max(map(len, prompts))
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            valid[i, width - len(p):] = True
            ids[i, width - len(p):] = torch.tensor(p)
        start = torch.tensor([len(self.tokens.get(r, [])) for r in rows])[:, None]
        positions = start + (valid.long().cumsum(1) - 1).clamp(min=0)
        self.controller.config.prefill_chunk_size = chunk
        self.controller.prefill(self.model, rows, ids, None, positions, valid, 1)
        for r, p in zip(rows, prompts):
            self.tokens[r] = self.tokens.get(r, []) + p

    @rule(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=21), min_size=1, max_size=3),
          chunk=st.sampled_from([None, 3, 8]))
    @precondition(lambda self: len(self.tokens) <= MAX_ROWS - 3)
    def new_prompts(self, prompts: list[list[int]], chunk: int | None) -> None:
        self.controller.reserve(len(prompts), max(map(len, prompts)), 8)
        self._prefill(self.controller.add_sequences(len(prompts)), prompts, chunk)

    @rule(data=st.data(), chunk=st.sampled_from([None, 5]))
    @precondition(lambda self: self.tokens)
    def second_prompts(self, data, chunk: int | None) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=2, unique=True))
        prompts = [data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=13)) for _ in rows]
        if all(len(self.tokens[r]) + len(p) <= MAX_POS for r, p in zip(rows, prompts)):
            self._prefill(rows, prompts, chunk)

    @rule(data=st.data(), steps=st.integers(1, 6))
    @precondition(lambda self: self.tokens)
    def decode(self, data, steps: int) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        for _ in range(steps):
            if any(len(self.tokens[r]) >= MAX_POS for r in rows):
                return
            ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(rows), max_size=len(rows)))
            positions = torch.tensor([[len(self.tokens[r])] for r in rows])
            self.controller.decode(self.model, rows, torch.tensor(ids)[:, None], positions)
            for r, t in zip(rows, ids):
                self.tokens[r].append(t)

    @rule(data=st.data())
    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_ROWS)
    def fork(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        (new,) = self.controller.fork_rows([row])
        self.tokens[new] = list(self.tokens[row])

    @rule(data=st.data())
    @precondition(lambda self: self.tokens)
    def release(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        self.controller.release_rows([row])
        del self.tokens[row]

    @invariant()
    def storage_is_kivis_state(self) -> None:
        m = self.controller.manager
        if m is None:
            return
        assert sorted(m.live_rows) == sorted(self.tokens)
        holders = np.zeros(m.num_pages, dtype=np.int64)
        for row, tokens in self.tokens.items():
            n = len(tokens)
            for layer in range(LAYERS):
                np.add.at(holders, m.pages_of(row, layer), 1)
                count, k, v, pos = kivi_state(self.controller, row, layer)
                assert count == n
                assert (pos == torch.arange(n)).all()
                full_k, full_v = self.model.kv(layer, torch.tensor(tokens), torch.arange(n))
                for h in range(KV_HEADS):
                    want_k, want_v = kivi_floats(full_k[h], full_v[h], self.spec)
                    torch.testing.assert_close(k[h], want_k, atol=1e-5, rtol=0)
                    torch.testing.assert_close(v[h], want_v, atol=1e-5, rtol=0)
        assert (m.allocator.refcounts(np.arange(m.num_pages)) == holders).all()


TestKiviMachine = KiviMachine.TestCase
TestKiviMachine.settings = settings(max_examples=15, stateful_step_count=20, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
