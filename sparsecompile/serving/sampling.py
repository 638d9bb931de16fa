"""Token sampling for the serving runtime: penalties, logit bias, min-tokens, greedy, temperature, top-k,
top-p, min-p, per-request seeds, and the log-probabilities requests ask for.

One call samples a whole batch; every row carries its own :class:`SamplingParams`. Everything runs in fp32
in this order (vLLM's order; vLLM's V1 sampler moves min-p before top-k / top-p, which only matters when
min-p and top-p are combined):

0. logits processing, only for rows that ask for it (:func:`process_logits`): ``min_tokens`` masks EOS and
   ``stop_token_ids`` until that many tokens exist, ``logit_bias`` adds its biases, then the penalties
   (repetition over prompt + output tokens, frequency and presence over output tokens);
1. temperature: ``logits / temperature`` (below ``SAMPLING_EPS``, e.g. 0, greedy: ``argmax`` of the processed
   fp32 logits, no randomness);
2. top-k: keep the ``top_k`` largest (0 or -1 = off; read from a ``topk`` of the rows' largest ``top_k``, not a
   sort of the vocabulary, up to :data:`TOPK_FIRST_MAX`);
3. top-p: keep the smallest set of most likely tokens whose probability (after top-k) reaches ``top_p`` (without
   top-k: from the :data:`NUCLEUS_CANDIDATES` most likely when they hold it);
   the most likely token is always kept (so ``top_p=1e-50`` is greedy, not empty);
4. min-p: drop tokens whose probability is below ``min_p`` times the most likely one's;

then sample from the renormalised distribution with the exponential race: ``argmax(probs / E)`` with
``E ~ Exponential(1)`` i.i.d. per token picks token ``i`` with probability ``probs[i] / sum(probs)``, so
dropped tokens (probability 0) are never chosen and no explicit renormalisation is needed.

A row whose probabilities are not finite (NaN or inf logits from the model, a temperature that overflows)
falls back to the argmax of its processed logits instead of sampling from garbage.

Seeds: a row with a generator draws its ``E`` from that generator only (``vocab`` numbers per step), so
its tokens do not depend on what else is batched; rows without one share one draw from the default RNG.

Log-probabilities (:func:`token_logprobs`) are computed only for the rows that ask, from the raw logits.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from ..kernels.argmax import first_argmax
from .outputs import SamplingParams

__all__ = ["TokenHistory", "make_generator", "process_logits", "sample", "token_logprobs"]

_MAX_TEMPERATURE = 1e30  # larger temperatures (e.g. 1e300) would become inf in fp32; 1e30 is already uniform


class TokenHistory:
    """The tokens a row's penalties and ``min_tokens`` look at: its prompt and its generated tokens.

    ``output_ids`` is read at every call (the engine passes the live list it appends to and never cuts; a list cut
    must be read before it grows again); :meth:`output_array` copies only the tokens added since the last call into
    an int64 array, so a step's penalties convert the batch's new tokens on the host, not every row's whole output
    again (256 rows of 512 tokens on the CI CPU: 8.5 ms a step as Python lists turned into tensors, 0.55 ms as
    arrays joined, `benchmarks/sessions/penalty_host_cost.py`). The prompt is copied to the device once
    (``prompt_tensor``), not at every step.
    """

    __slots__ = ("prompt_ids", "output_ids", "_prompt", "_outputs", "_synced")

    def __init__(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self._prompt: torch.Tensor | None = None
        self._outputs = np.empty(0, dtype=np.int64)
        self._synced = 0  # leading tokens of output_ids already in _outputs

    def output_array(self) -> np.ndarray:
        """``output_ids`` as an int64 array (a view of a buffer that grows by doubling; read it before the next
        call)."""
        n = len(self.output_ids)
        if n < self._synced:  # the list was cut (not done by the engine): copy all of it again
            self._synced = 0
        if n > len(self._outputs):
            grown = np.empty(max(n, 2 * len(self._outputs), 64), dtype=np.int64)
            grown[: self._synced] = self._outputs[: self._synced]
            self._outputs = grown
        if n > self._synced:
            self._outputs[self._synced: n] = self.output_ids[self._synced: n]
            self._synced = n
        return self._outputs[:n]

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        if self._prompt is None or self._prompt.device != device:
            self._prompt = torch.tensor(list(self.prompt_ids), dtype=torch.long, device=device)
        return self._prompt


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


#: Candidates (largest logits) a row without top-k reads for its top-p nucleus before it sorts every column
#: (``results/sampling_filter_cost_cpu.jsonl``, 256 rows of 128,256 logits on the CI CPU, top_p 0.9: ``sample()``
#: 2,685 -> 1,132 ms where the candidates hold the nucleus, ``randn * 8`` logits; 2,615 -> 2,743 ms where they
#: do not and the rows sort after all, ``randn``).
NUCLEUS_CANDIDATES = 1024

#: Largest ``top_k`` filtered from a ``topk`` of that many columns instead of a sort of the whole vocabulary (256
#: rows of 128,256 logits on the CI CPU, ``results/sampling_filter_cost_cpu.jsonl``: a sort 1,336 ms, ``topk(50)``
#: 25 ms, ``topk(4096)`` 163 ms; ``sample()`` at top_k 50, top_p 0.9: 2,602 -> 1,018 ms).
TOPK_FIRST_MAX = 4096


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int) -> torch.Tensor:
    """Mask (with -inf) what top-k then top-p drop, from the ``width`` largest logits of each row (sorted once).

    Args:
        x: ``[rows, vocab]`` fp32 tempered logits.
        top_k: ``[rows]`` int64 tokens kept (``vocab`` = off).
        top_p: ``[rows]`` fp32 nucleus mass (1 = off).
        width: columns that can survive, ``>= max(top_k)`` (a host int: the whole vocabulary when a row keeps all
            of it, else the largest ``top_k``, whose ``topk`` costs far less than a sort of every column).

    Returns:
        ``[rows, vocab]`` logits, dropped tokens at -inf.
    """
    vocab = x.shape[-1]
    if width < vocab:
        values, order = x.topk(width, dim=-1)  # sorted, descending
    else:
        values, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(values.shape[-1], device=x.device)
    values = values.masked_fill(rank >= top_k[:, None], -torch.inf)
    probs = values.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens (0 for the top token)
    drop = (before >= top_p[:, None]) & (top_p < 1)[:, None]  # rows at top_p=1 keep all (cumsum may pass 1)
    drop[:, 0] = False  # the most likely token stays, even for a top_p that rounds to 0 in fp32
    values = values.masked_fill(drop, -torch.inf)
    out = torch.empty_like(x) if width >= vocab else torch.full_like(x, -torch.inf)  # a sort covers every column
    return out.scatter_(-1, order, values)


def _top_p_nucleus(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (with -inf) what top-p drops from rows without a top-k filter, reading their
    :data:`NUCLEUS_CANDIDATES` largest logits instead of sorting every column when those hold the nucleus.

    The nucleus is the shortest run of the most likely tokens whose mass reaches ``top_p``: when the candidates' mass
    (full-vocabulary probabilities, ``exp(x - logsumexp(x))``) reaches ``top_p`` in a row, every token past them is
    dropped, so the candidates decide alone. A row whose candidates hold less (a flat distribution) needs the sort:
    then the whole group takes :func:`_top_k_top_p` (one host sync a call to know which case it is).

    Args:
        x: ``[rows, vocab]`` fp32 tempered logits.
        top_p: ``[rows]`` fp32 nucleus mass (< 1).
    """
    vocab = x.shape[-1]
    width = min(NUCLEUS_CANDIDATES, vocab)
    if width < vocab:
        values, order = x.topk(width, dim=-1)  # sorted, descending
        probs = (values - x.logsumexp(dim=-1, keepdim=True)).exp()
        mass = probs.cumsum(dim=-1)
    if width == vocab or not bool((mass[:, -1] >= top_p).all()):  # some nucleus reaches past the candidates: sort
        return _top_k_top_p(x, torch.full_like(top_p, vocab, dtype=torch.long), top_p, vocab)
    drop = mass - probs >= top_p[:, None]
    drop[:, 0] = False  # the most likely token stays, even for a top_p that rounds to 0 in fp32
    return torch.full_like(x, -torch.inf).scatter_(-1, order, values.masked_fill(drop, -torch.inf))


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
    for i in seeded:  # in place on the row (contiguous, ``vocab`` numbers: the draw of a fresh tensor, one launch)
        q[i].exponential_(generator=generators[i])
    # Exponential draws can be exactly 0 (u = 1 in -log(1 - u) style samplers); keep probs / q finite.
    return q.clamp_(min=torch.finfo(torch.float32).tiny)


def _flat_pairs(lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(row index, token id)`` pairs of ragged int64 token tensors (all on one device), as two flat tensors."""
    device = lists[0].device
    lengths = [len(t) for t in lists]
    rows = torch.repeat_interleave(torch.arange(len(lists), device=device), torch.tensor(lengths, device=device),
                                   output_size=sum(lengths))  # given: no device-to-host sync for the size
    return rows, torch.cat(lists)


def process_logits(x: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None],
                   eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """Apply ``min_tokens``, ``logit_bias`` and the penalties, in vLLM's order, to the rows that ask for them.

    Args:
        x: ``[batch, vocab]`` fp32 logits, modified in place and returned.
        params: one :class:`SamplingParams` per row.
        histories: one :class:`TokenHistory` per row (None allowed for rows with ``processes_logits`` False).
        eos_token_ids: the model's end-of-sequence ids, masked with ``stop_token_ids`` until ``min_tokens`` (unless
            the row sets ``ignore_eos``).

    Penalties follow vLLM: a token of the prompt or the output gets ``logit / repetition_penalty`` when the logit
    is positive and ``logit * repetition_penalty`` otherwise; then ``frequency_penalty * count`` and
    ``presence_penalty * (count > 0)`` are subtracted, counting output tokens only.
    """
    vocab, device = x.shape[-1], x.device
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    for i in rows:
        if histories[i] is None:
            raise ValueError(f"process_logits: row {i} uses penalties, logit_bias or min_tokens and needs a "
                             "TokenHistory")
    # 1. min_tokens: EOS and stop tokens cannot end a completion that is still too short
    mask_rows, mask_ids = [], []
    for i in rows:
        p = params[i]
        if len(histories[i].output_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = sorted(t for t in stops if 0 <= t < vocab)
            mask_rows += [i] * len(ids)
            mask_ids += ids
    if mask_ids:
        x[torch.tensor(mask_rows, device=device), torch.tensor(mask_ids, device=device)] = -torch.inf
    # 2. logit_bias
    bias_rows, bias_ids, biases = [], [], []
    for i in rows:
        for token, bias in (params[i].logit_bias or {}).items():
            if token < vocab:
                bias_rows.append(i)
                bias_ids.append(token)
                biases.append(float(bias))
    if bias_ids:
        x.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device)),
                     torch.tensor(biases, dtype=x.dtype, device=device), accumulate=True)
    # 3. penalties over prompt + output (repetition) and output (frequency, presence) tokens
    pen = [i for i in rows if params[i].has_penalties]
    if pen:
        index = torch.tensor(pen, device=device)
        sub = x[index]
        # Token ids >= vocab (impossible from the sampler; a prompt may hold them) land in an extra column.
        counts = torch.zeros(len(pen), vocab + 1, dtype=x.dtype, device=device)
        outputs = [histories[i].output_array() for i in pen]
        lengths = np.fromiter((len(o) for o in outputs), dtype=np.int64, count=len(outputs))
        if lengths.any():  # every (row, output token) pair
            out_ids = torch.from_numpy(np.concatenate(outputs)).to(device).clamp_(max=vocab)
            out_rows = torch.from_numpy(np.repeat(np.arange(len(pen), dtype=np.int64), lengths)).to(device)
            counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=x.dtype), accumulate=True)
        counts = counts[:, :vocab]
        generated = counts > 0
        seen = torch.zeros(len(pen), vocab + 1, dtype=torch.bool, device=device)
        prompt_rows, prompt_ids = _flat_pairs([histories[i].prompt_tensor(device) for i in pen])
        seen[prompt_rows, prompt_ids.clamp(max=vocab)] = True
        seen = seen[:, :vocab] | generated

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(params[i], name) for i in pen], dtype=x.dtype, device=device)[:, None]

        repetition = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * generated.to(x.dtype)
        x.index_copy_(0, index, sub)
    return x


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``tokens`` under ``logits`` and the ``num_top`` most likely tokens.

    Args:
        logits: ``[rows, vocab]`` raw logits (any float dtype; log-softmax taken in fp32).
        tokens: ``[rows]`` int64, the token whose log-probability each row reports.
        num_top: most likely tokens returned per row (0: none).

    Returns:
        ``(logprob [rows] fp32, rank [rows] int64, top_logprobs [rows, num_top] fp32, top_ids [rows, num_top]
        int64)``; rank 1 is the most likely token (vLLM's count of tokens at least as likely, the token included).
    """
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    rank = (lp >= chosen[:, None]).sum(dim=-1)
    if num_top > 0:
        top_lp, top_ids = lp.topk(min(num_top, lp.shape[-1]), dim=-1)
    else:
        top_lp = lp.new_empty(lp.shape[0], 0)
        top_ids = torch.empty(lp.shape[0], 0, dtype=torch.long, device=lp.device)
    return chosen, rank, top_lp, top_ids


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[TokenHistory | None] | None = None, eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """Sample one token per row.

    Args:
        logits: ``[batch, vocab]``, any float dtype and device (not modified).
        params: ``batch`` :class:`SamplingParams`; row ``i`` uses ``params[i]``.
        generators: ``batch`` generators on the logits' device (see :func:`make_generator`), or None to use
            the default torch RNG for that row. Greedy rows consume no randomness.
        histories: per row, the tokens penalties and ``min_tokens`` read (needed only by rows that use them).
        eos_token_ids: the ids ``min_tokens`` masks besides each row's ``stop_token_ids``.

    Returns:
        ``[batch]`` int64 token ids on the logits' device. Greedy rows (``temperature < SAMPLING_EPS``) without
        logits processing hold exactly ``logits.float().argmax(-1)``; the others are drawn as the module docstring
        describes.
    """
    _check_inputs(logits, params, generators)
    device = logits.device
    x = logits.float()
    if any(p.processes_logits for p in params):
        if histories is None or len(histories) != len(params):
            raise ValueError("sample: penalties, logit_bias and min_tokens need one TokenHistory per row")
        x = process_logits(x.clone() if x is logits else x, params, histories, eos_token_ids)
    tokens = first_argmax(x)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    vocab = x.shape[-1]
    if len(rows) < len(params):
        x = x[torch.tensor(rows, device=device)]
    sub = [params[i] for i in rows]

    temperature = torch.tensor([min(p.temperature, _MAX_TEMPERATURE) for p in sub], dtype=torch.float32,
                               device=device)
    # Shift by the row max first: the softmax is unchanged and a tiny temperature cannot overflow to inf.
    x = (x - x.max(dim=-1, keepdim=True).values) / temperature[:, None]

    # filters without a sort of the vocabulary where they can: a small top-k from a topk of the rows' largest k,
    # top-p alone from the nucleus candidates; a large top-k sorts
    kept = [p.top_k if 0 < p.top_k < vocab else vocab for p in sub]
    small, nucleus, large = [], [], []
    for j, p in enumerate(sub):
        if kept[j] <= TOPK_FIRST_MAX and kept[j] < vocab:
            small.append(j)
        elif kept[j] < vocab:
            large.append(j)
        elif p.top_p < 1:
            nucleus.append(j)
    for group, width in ((small, max((kept[j] for j in small), default=0)), (nucleus, 0), (large, vocab)):
        if not group:
            continue
        top_p = torch.tensor([sub[j].top_p for j in group], dtype=torch.float32, device=device)
        index = torch.tensor(group, device=device) if len(group) < len(sub) else None
        rows_x = x if index is None else x[index]
        if group is nucleus:
            filtered = _top_p_nucleus(rows_x, top_p)
        else:
            filtered = _top_k_top_p(rows_x, torch.tensor([kept[j] for j in group], device=device), top_p, width)
        x = filtered if index is None else x.index_copy(0, index, filtered)

    probs = x.softmax(dim=-1)
    if any(p.min_p > 0 for p in sub):
        probs = _min_p(probs, torch.tensor([p.min_p for p in sub], dtype=torch.float32, device=device))

    q = _exponentials(probs.shape, [generators[i] for i in rows], device)
    drawn = first_argmax(probs / q)
    # Never sample from NaN / inf: such rows (bad logits, an overflowing temperature) take their argmax.
    broken = ~torch.isfinite(probs).all(dim=-1)
    fallback = tokens if len(rows) == len(params) else tokens[torch.tensor(rows, device=device)]
    drawn = torch.where(broken, fallback, drawn)
    if len(rows) == len(params):
        return drawn
    return tokens.index_copy(0, torch.tensor(rows, device=device), drawn)
