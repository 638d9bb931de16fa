"""Full-precision buffers of the ``kivi`` storage format kept past a layer's commit (mixed into
:class:`~sparsecompile.runtime.kivi.KiviStorage`).

A prefill step materialises every slot of its rows in full precision (``W``, per layer). Normally each layer
quantizes what aged out of the residual at once; three cases keep ``W`` longer:

* a deferred step (the method moves resident slots after the prompt: eviction): the moves happen in ``W``
  (:meth:`DeferredCommits.move`), then the kept slots are quantized once (:meth:`DeferredCommits.commit_deferred`);
* held rows (KVzip: the prompt stays in full precision through its scoring passes): :meth:`DeferredCommits.hold`
  keeps ``W`` until :meth:`DeferredCommits.release_held`; later steps over those rows read their history from it;
* a policy that evicts after every chunk (``h2o+kivi``): :meth:`DeferredCommits.settle_chunk` holds the rows whose
  prompt goes on and quantizes the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .kivi_spec import KiviSpec
    from .step import StepState


class DeferredCommits:
    """The deferred / held full-precision buffers of :class:`KiviStorage` (module docstring)."""

    manager: Any  # the owning CacheManager
    spec: KiviSpec
    _work: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> this step's W key / value [B, H, S + 1, D]
    _defer: bool
    _step_rows: list[int]
    _before: np.ndarray | None
    _held: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> W of _held_rows, in that order
    _held_rows: list[int]

    def _commit_from(self, layer: int, rows: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, start: np.ndarray,
                     final: np.ndarray) -> None:
        """Quantize ``[start, Q(final))`` of ``W`` and put the rest in the ring (:class:`KiviStorage` defines it)."""
        raise NotImplementedError

    @property
    def held_rows(self) -> tuple[int, ...]:
        """Rows whose prompt is held in full precision past its step (:meth:`hold`) until :meth:`release_held`."""
        return tuple(self._held_rows)

    def commit_deferred(self, step: StepState) -> None:
        """After the method's ``commit_step`` (slot counts final): quantize the kept slots of every deferred layer
        from the full-precision buffer; rows whose slots moved are stored again from slot 0."""
        if not self._defer:
            return
        m = self.manager
        after = m.slot_count_array(step.row_ids)
        moved = after < self._before + np.asarray(step.num_new_host)[:, None]
        start = np.where(moved, 0, self.spec.quantized(self._before))
        for layer, (wk, wv) in sorted(self._work.items()):
            self._commit_from(layer, step.rows, wk, wv, start[:, layer], after[:, layer])
        self._work.clear()
        self._defer, self._before, self._step_rows = False, None, []

    def hold(self) -> None:
        """Instead of :meth:`commit_deferred`: keep the deferred step's full-precision buffers past the step. Later
        prefill steps over those rows (scoring passes) read their history from them and quantize nothing of it, moves
        (compaction) happen in them, truncations leave them alone, until :meth:`release_held`."""
        if not self._defer:
            return
        self._add_held(dict(self._work), list(self._step_rows))
        self._work.clear()
        self._defer, self._before, self._step_rows = False, None, []

    def settle_chunk(self, step: StepState, continuing: list[bool]) -> None:
        """Instead of :meth:`commit_deferred`, after a deferred prefill step of a policy that evicts after every
        chunk (``h2o+kivi``): the rows whose prompt goes on keep this step's full-precision buffer (held: the next
        chunk's view reads their history from it, replacing what was held for them), the others are quantized from
        it once (from slot 0 when their slots moved or were held, as :meth:`commit_deferred`)."""
        if not self._defer:
            return
        rows, dev = list(self._step_rows), self.manager.layout.device
        after = self.manager.slot_count_array(rows)
        moved = after < self._before + np.asarray(step.num_new_host)[:, None]
        held = np.array([r in self._held_rows for r in rows])[:, None]
        start = np.where(moved | held, 0, self.spec.quantized(self._before))
        self._forget_held(rows)  # their history is in this step's buffer now
        go_on = np.asarray(continuing, dtype=bool)
        done, held_on = np.nonzero(~go_on)[0], np.nonzero(go_on)[0]
        if len(done):
            at = torch.as_tensor(done, device=dev)
            for layer, (wk, wv) in sorted(self._work.items()):
                self._commit_from(layer, step.rows[at], wk[at], wv[at], start[done, layer], after[done, layer])
        if len(held_on):
            at = torch.as_tensor(held_on, device=dev)
            self._add_held({layer: (wk[at], wv[at]) for layer, (wk, wv) in self._work.items()},
                           [rows[i] for i in held_on])
        self._work.clear()
        self._defer, self._before, self._step_rows = False, None, []

    def _add_held(self, work: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: list[int]) -> None:
        """Hold ``work`` (layer -> W of ``rows``) beside what is held: one buffer, padded to the wider."""
        if self._held_rows:
            def joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                width = max(a.shape[2], b.shape[2])  # (the last column stays a trash column)
                return torch.cat([torch.nn.functional.pad(t, (0, 0, 0, width - t.shape[2])) for t in (a, b)])
            work = {layer: tuple(joined(h, w) for h, w in zip(self._held[layer], work[layer])) for layer in work}
            rows = self._held_rows + rows
        self._held, self._held_rows = work, rows

    def _forget_held(self, rows: list[int]) -> None:
        """Drop the held buffers of ``rows`` (the others stay held)."""
        rest = [i for i, r in enumerate(self._held_rows) if r not in rows]
        if len(rest) == len(self._held_rows):
            return
        if not rest:
            self._held, self._held_rows = {}, []
            return
        keep = torch.tensor(rest, device=self.manager.layout.device)
        self._held = {layer: (wk[keep], wv[keep]) for layer, (wk, wv) in self._held.items()}
        self._held_rows = [self._held_rows[i] for i in rest]

    def release_held(self, rows: list[int]) -> None:
        """Quantize the held rows among ``rows`` from their buffers (slot counts final), once, from slot 0."""
        mine = [r for r in rows if r in self._held_rows]
        if not mine:
            return
        m, dev = self.manager, self.manager.layout.device
        index = torch.tensor(self._held_index(mine)[1], device=dev)
        after = m.slot_count_array(mine)
        for layer, (wk, wv) in sorted(self._held.items()):
            self._commit_from(layer, torch.tensor(mine, device=dev), wk[index], wv[index],
                              np.zeros(len(mine), dtype=np.int64), after[:, layer])
        self._forget_held(mine)

    def _held_index(self, row_ids: list[int]) -> tuple[list[int], list[int]]:
        """Positions in a step's batch of its held rows, and theirs in the held buffers."""
        pairs = [(i, self._held_rows.index(r)) for i, r in enumerate(row_ids) if r in self._held_rows]
        return [i for i, _ in pairs], [j for _, j in pairs]

    def move(self, layer: int, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """K/V half of ``CacheManager.move_slots`` (``src, dst [batch, kv_heads, n]`` row-local, -1 skips): only in
        the full-precision buffer of a deferred step (quantized slots never move; see the module docstring)."""
        if not self._defer and layer in self._held:  # compaction of held rows (host-driven, eager; a scoring pass's
            # buffers, never committed, may linger in _work until the next step begins)
            at = torch.tensor(self._held_index(rows.tolist())[1], device=src.device)
            hk, hv = self._held[layer]
            wk, wv = hk[at], hv[at]
            self._move_in(wk, wv, src, dst)
            hk[at], hv[at] = wk, wv
            return
        if layer not in self._work:
            raise RuntimeError("kivi: resident slots can only move during a prefill step the method announced "
                               "(KiviStorage.begin_step(defer=True)) or in rows it holds; quantized slots never move")
        self._move_in(*self._work[layer], src, dst)

    @staticmethod
    def _move_in(wk: torch.Tensor, wv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        batch, H, trash, _ = wk.shape
        b = torch.arange(batch, device=src.device)[:, None, None].expand_as(src)
        h = torch.arange(H, device=src.device)[None, :, None].expand_as(src)
        moved = (wk[b, h, src.clamp(min=0)], wv[b, h, src.clamp(min=0)])  # read before writing
        dst = torch.where(dst >= 0, dst, trash - 1)  # no boolean indexing: no host sync
        for pool, values in zip((wk, wv), moved):
            pool[b, h, dst] = values
