"""Token sampling for the serving runtime: greedy, temperature, top-k, top-p, min-p, per-request seeds.

One call samples a whole batch; every row carries its own :class:`SamplingParams`. Filters run in fp32
in this order (vLLM's V0 sampler and HF ``generate`` apply them so; vLLM's V1 sampler moves min-p
before top-k / top-p, which only matters when min-p and top-p are combined):

1. temperature: ``logits / temperature`` (0 = greedy: ``argmax`` of the fp32 logits, no randomness);
2. top-k: keep the ``top_k`` largest (0 or -1 = off);
3. top-p: keep the smallest set of most likely tokens whose probability (after top-k) reaches ``top_p``;
   the most likely token is always kept;
4. min-p: drop tokens whose probability is below ``min_p`` times the most likely one's;

then sample from the renormalised distribution with the exponential race: ``argmax(probs / E)`` with
``E ~ Exponential(1)`` i.i.d. per token picks token ``i`` with probability ``probs[i] / sum(probs)``, so
dropped tokens (probability 0) are never chosen and no explicit renormalisation is needed.

Seeds: a row with a generator draws its ``E`` from that generator only (``vocab`` numbers per step), so
its tokens do not depend on what else is batched; rows without one share one draw from the default RNG.
"""

from __future__ import annotations

import torch

from .outputs import SamplingParams

__all__ = ["make_generator", "sample"]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed`` (reduced modulo 2**64), or None for no seed."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an integer or None, got {seed!r}")
    return torch.Generator(device=torch.device(device)).manual_seed(seed % 2**64)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the current one is 0; compare type and index."""
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index == b.index:
        return True
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def _check_inputs(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"sample: logits must be floating point, got {logits.dtype}")
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(f"sample: {batch} logits rows need as many SamplingParams and generators, "
                         f"got {len(params)} and {len(generators)}")
    for i, g in enumerate(generators):
        if g is not None and not _same_device(g.device, logits.device):
            raise ValueError(f"sample: generator of row {i} is on {g.device} but the logits are on {logits.device}; "
                             f"create it with make_generator(seed, logits.device)")


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top-k then top-p drop. One descending sort per row.

    Args:
        x: ``[rows, vocab]`` fp32 tempered logits.
        top_k: ``[rows]`` int64 tokens kept (``vocab`` = off).
        top_p: ``[rows]`` fp32 nucleus mass (1 = off).

    Returns:
        ``[rows, vocab]`` logits, dropped tokens at -inf.
    """
    vocab = x.shape[-1]
    values, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device)
    values = values.masked_fill(rank >= top_k[:, None], -torch.inf)
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens (0 for the top token)
    drop = (before >= top_p[:, None]) & (top_p < 1)[:, None]  # rows at top_p=1 keep all (cumsum may pass 1)
    values = values.masked_fill(drop, -torch.inf)
    return torch.empty_like(x).scatter_(-1, order, values)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero ``probs [rows, vocab]`` below ``min_p [rows]`` times each row's largest probability."""
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < floor, 0.0)


def _exponentials(shape: torch.Size, generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` i.i.d. Exponential(1): seeded rows from their own generator, the rest in one draw."""
    rows, vocab = shape
    seeded = [i for i, g in enumerate(generators) if g is not None]
    q = torch.empty(rows, vocab, dtype=torch.float32, device=device)
    if len(seeded) < rows:
        q.exponential_()
    for i in seeded:
        q[i] = torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=generators[i])
    # Exponential draws can be exactly 0 (u = 1 in -log(1 - u) style samplers); keep probs / q finite.
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: ``[batch, vocab]``, any float dtype and device (not modified).
        params: ``batch`` :class:`SamplingParams`; row ``i`` uses ``params[i]``.
        generators: ``batch`` generators on the logits' device (see :func:`make_generator`), or None to use
            the default torch RNG for that row. Greedy rows consume no randomness.

    Returns:
        ``[batch]`` int64 token ids on the logits' device. Greedy rows (``temperature == 0``) hold exactly
        ``logits.float().argmax(-1)``; the others are drawn as the module docstring describes.
    """
    _check_inputs(logits, params, generators)
    device = logits.device
    x = logits.float()
    tokens = x.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    if not rows:
        return tokens
    vocab = x.shape[-1]
    if len(rows) < len(params):
        x = x[torch.tensor(rows, device=device)]
    sub = [params[i] for i in rows]

    temperature = torch.tensor([p.temperature for p in sub], dtype=torch.float32, device=device)
    # Shift by the row max first: the softmax is unchanged and a tiny temperature cannot overflow to inf.
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]

    filtered = [j for j, p in enumerate(sub) if 0 < p.top_k < vocab or p.top_p < 1]
    if filtered:
        top_k = torch.tensor([sub[j].top_k if 0 < sub[j].top_k < vocab else vocab for j in filtered], device=device)
        top_p = torch.tensor([sub[j].top_p for j in filtered], dtype=torch.float32, device=device)
        if len(filtered) == len(sub):
            x = _top_k_top_p(x, top_k, top_p)
        else:
            index = torch.tensor(filtered, device=device)
            x = x.index_copy(0, index, _top_k_top_p(x[index], top_k, top_p))

    probs = x.softmax(dim=-1)
    if any(p.min_p > 0 for p in sub):
        probs = _min_p(probs, torch.tensor([p.min_p for p in sub], dtype=torch.float32, device=device))

    q = _exponentials(probs.shape, [generators[i] for i in rows], device)
    drawn = (probs / q).argmax(dim=-1)
    if len(rows) == len(params):
        return drawn
    return tokens.index_copy(0, torch.tensor(rows, device=device), drawn)
