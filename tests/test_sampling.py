"""Token sampling (``runtime/sampling.py``) and SamplingParams validation.

Supports are checked exactly on hand-built distributions whose filtered sets are known, distributions
with a chi-square test over ~20k draws, seeds for reproducibility and independence from the batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsecompile.serving import sampling
from sparsecompile.serving.outputs import RequestRejected, SamplingParams
from sparsecompile.serving.sampling import TokenHistory, make_generator, process_logits, sample, token_logprobs

# Chi-square critical values at p = 1e-4 (degrees of freedom -> value): a correct sampler fails once in 10^4 runs,
# and every test seeds its RNG, so a run is deterministic anyway.
CHI2_CRIT = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}

# A known distribution, deliberately not sorted by token id: token -> probability.
PROBS = {3: 0.40, 0: 0.25, 5: 0.15, 1: 0.10, 4: 0.06, 2: 0.04}
VOCAB = 6


@pytest.fixture(autouse=True)
def _seed_default_rng():
    torch.manual_seed(1234)


def known_logits(rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[rows, VOCAB]`` logits whose softmax is PROBS."""
    p = torch.tensor([PROBS[i] for i in range(VOCAB)], dtype=torch.float64)
    return p.log().to(dtype).expand(rows, VOCAB).contiguous()


def draws(params: SamplingParams, rows: int = 4000) -> np.ndarray:
    """``rows`` independent draws of one distribution (one row each, default RNG)."""
    out = sample(known_logits(rows), [params] * rows, [None] * rows)
    return out.numpy()


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    n = counts.sum()
    expected = expected_probs * n
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_fp32_argmax(dtype):
    logits = (torch.randn(7, 301) * 4).to(dtype)
    out = sample(logits, [SamplingParams(temperature=0)] * 7, [None] * 7)
    assert out.dtype == torch.int64 and out.shape == (7,) and out.device == logits.device
    assert torch.equal(out, logits.float().argmax(-1))


def test_greedy_consumes_no_randomness():
    logits = torch.randn(3, 50)
    state = torch.get_rng_state()
    sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert torch.equal(torch.get_rng_state(), state)


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.zeros(6, 200)  # flat rows: sampled rows spread out, greedy rows pick the planted maximum
    peaks = torch.tensor([17, 3, 199, 42, 0, 120])
    logits[torch.arange(6), peaks] = 0.5
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0) for i in range(6)]
    gens = [None, make_generator(7, "cpu"), None, None, None, make_generator(8, "cpu")]
    seen = {1: set(), 3: set(), 5: set()}
    for _ in range(30):
        out = sample(logits, params, gens)
        assert out[0::2].tolist() == peaks[0::2].tolist()
        for i in seen:
            seen[i].add(int(out[i]))
    assert all(len(s) > 10 for s in seen.values())  # the sampled rows really sampled


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 500) * 3
    params = [SamplingParams(temperature=t, top_k=1) for t in np.linspace(0.3, 3.0, 64)]
    out = sample(logits, params, [None] * 64)
    assert torch.equal(out, logits.argmax(-1))


def test_tiny_temperature_is_finite_and_greedy():
    logits = torch.randn(16, 1000) * 10
    out = sample(logits, [SamplingParams(temperature=1e-6)] * 16, [None] * 16)
    assert torch.equal(out, logits.argmax(-1))


# ---------------------------------------------------------------------------------------------- supports
def test_top_k_never_samples_outside_top_k():
    logits = torch.randn(1, 1000) * 2
    top = set(logits[0].topk(5).indices.tolist())
    rows = 3000
    out = sample(logits.expand(rows, -1), [SamplingParams(temperature=1.5, top_k=5)] * rows, [None] * rows)
    assert set(out.tolist()) == top


@pytest.mark.parametrize("top_p,support", [
    (0.3, {3}),  # the top token alone already reaches 0.3
    (0.6, {3, 0}),  # 0.40 < 0.6 <= 0.65
    (0.7, {3, 0, 5}),  # 0.65 < 0.7 <= 0.80
    (0.95, {3, 0, 5, 1, 4}),  # 0.91 < 0.95 <= 0.97
    (1.0, set(PROBS)),
])
def test_top_p_support_is_the_nucleus(top_p, support):
    assert set(draws(SamplingParams(temperature=1.0, top_p=top_p)).tolist()) == support


def test_top_p_uses_probabilities_after_top_k():
    # top-k 3 renormalises to 0.5, 0.3125, 0.1875: top-p 0.7 then keeps two tokens (top-p alone keeps three)
    assert set(draws(SamplingParams(temperature=1.0, top_k=3, top_p=0.7)).tolist()) == {3, 0}


@pytest.mark.parametrize("min_p,support", [
    (0.2, {3, 0, 5, 1}),  # floor 0.08
    (0.3, {3, 0, 5}),  # floor 0.12
    (0.5, {3, 0}),  # floor 0.20
    (0.9, {3}),
])
def test_min_p_support(min_p, support):
    assert set(draws(SamplingParams(temperature=1.0, min_p=min_p)).tolist()) == support


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), vocab=st.integers(2, 300))
@settings(max_examples=40, deadline=None)
def test_top_k_from_a_topk_equals_top_k_from_a_sort(seed, rows, vocab):
    """Rows with a top-k filter read only their ``max(top_k)`` largest logits (``topk``) instead of sorting all of
    them: the same filtered logits (random logits: no ties at the k-th), top-p applied after top-k as before."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    top_k = torch.randint(1, vocab + 1, (rows,), generator=g)
    top_p = torch.where(torch.rand(rows, generator=g) < 0.5, torch.rand(rows, generator=g), torch.ones(rows))
    got = sampling._top_k_top_p(x, top_k, top_p, int(top_k.max()))
    assert torch.equal(got, sampling._top_k_top_p(x, top_k, top_p, vocab))


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), vocab=st.integers(2, 300), candidates=st.integers(1, 64),
       scale=st.sampled_from([0.5, 3.0, 8.0]))
@settings(max_examples=60, deadline=None)
def test_top_p_from_its_candidates_keeps_the_nucleus_a_sort_keeps(seed, rows, vocab, candidates, scale):
    """Rows with top-p alone read their ``NUCLEUS_CANDIDATES`` largest logits when those hold the nucleus (peaked
    rows), and sort otherwise (flat rows): the tokens kept are the sort's, but for a row whose boundary token's
    preceding mass is within 1e-5 of ``top_p`` (the two compute the probabilities in a different order)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    saved = sampling.NUCLEUS_CANDIDATES
    sampling.NUCLEUS_CANDIDATES = candidates
    try:
        got = sampling._top_p_nucleus(x, top_p)
    finally:
        sampling.NUCLEUS_CANDIDATES = saved
    want = sampling._top_k_top_p(x, torch.full((rows,), vocab), top_p, vocab)
    probs = x.softmax(-1).sort(dim=-1, descending=True).values.double()
    before = probs.cumsum(-1) - probs
    for r in range(rows):
        if not torch.equal(torch.isfinite(got[r]), torch.isfinite(want[r])):
            assert (before[r] - float(top_p[r])).abs().min() < 1e-5, r
        else:
            assert torch.equal(got[r], want[r])


def test_top_k_rows_and_sorted_rows_sample_alike(monkeypatch):
    """A batch mixing small top-k rows (topk), top-p-only rows (candidates), large top-k rows (sort) and unfiltered
    rows samples the same seeded tokens whichever path each row's filter takes."""
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=i) for i, (k, p) in
              enumerate([(3, 1.0), (0, 0.8), (30, 0.9), (0, 1.0), (39, 1.0), (5, 0.5)])]
    logits = torch.randn(len(params), 48, generator=torch.Generator().manual_seed(3)) * 3

    def draw() -> list[int]:
        return sample(logits, params, [make_generator(p.seed, "cpu") for p in params]).tolist()

    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 16)
    mixed = draw()  # small k by topk, top-p alone from its 16 candidates (or sorted where they hold too little)
    monkeypatch.setattr(sampling, "TOPK_FIRST_MAX", 0)  # every top-k row sorts
    assert draw() == mixed
    monkeypatch.setattr(sampling, "TOPK_FIRST_MAX", 10)  # k = 30 and 39 sort, 3 and 5 take topk
    assert draw() == mixed
    monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", 10**6)  # top-p alone sorts too
    assert draw() == mixed


def test_min_p_applies_after_top_p():
    # top-p 0.7 keeps {3, 0, 5} (renormalised 0.5, 0.3125, 0.1875); min-p 0.2 then keeps all three.
    # (min-p first would keep {3, 0, 5, 1}, after which top-p 0.7 keeps only {3, 0}.)
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.7, min_p=0.2)).tolist()) == {3, 0, 5}


def test_rows_filter_independently():
    rows = 2000
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, min_p=0.5)] * (rows // 4)
    out = sample(known_logits(rows), params, [None] * rows).view(-1, 4)
    assert set(out[:, 0].tolist()) == {3}
    assert set(out[:, 1].tolist()) == set(PROBS)
    assert set(out[:, 2].tolist()) == {3, 0}
    assert set(out[:, 3].tolist()) == {3, 0}


# ---------------------------------------------------------------------------------------------- distributions
def _expected(temperature: float = 1.0, keep: set[int] | None = None) -> np.ndarray:
    p = np.array([PROBS[i] for i in range(VOCAB)]) ** (1.0 / temperature)
    if keep is not None:
        p = np.where(np.isin(np.arange(VOCAB), list(keep)), p, 0.0)
    return p / p.sum()


def _check_distribution(tokens: np.ndarray, expected: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=VOCAB).astype(np.float64)
    support = expected > 0
    assert counts[~support].sum() == 0
    stat = chi_square(counts[support], expected[support])
    assert stat < CHI2_CRIT[int(support.sum()) - 1], (counts / counts.sum(), expected)
    assert np.abs(counts / counts.sum() - expected).max() < 0.02


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_tempered_softmax(temperature):
    _check_distribution(draws(SamplingParams(temperature=temperature), rows=20_000), _expected(temperature))


def test_temperature_sharpens_and_flattens():
    top = {t: (draws(SamplingParams(temperature=t), rows=20_000) == 3).mean() for t in (0.5, 1.0, 2.0)}
    assert top[0.5] > top[1.0] + 0.1 and top[1.0] > top[2.0] + 0.05  # expected about 0.62, 0.40, 0.27


def test_distribution_after_filters_is_renormalised():
    _check_distribution(draws(SamplingParams(temperature=1.0, top_k=4), rows=20_000), _expected(keep={3, 0, 5, 1}))
    _check_distribution(draws(SamplingParams(temperature=2.0, top_p=0.7), rows=20_000),
                        _expected(2.0, keep={3, 0, 5, 1}))  # at T=2: 0.274, 0.217, 0.168 (0.659), 0.137


def test_seeded_row_distribution():
    # One seeded row over many steps: its generator alone drives the draws, and they follow the distribution.
    g = make_generator(99, "cpu")
    logits = known_logits(1, torch.bfloat16)
    params = [SamplingParams(temperature=1.0, top_k=3)]
    tokens = np.array([int(sample(logits, params, [g])[0]) for _ in range(4000)])
    p = torch.tensor([PROBS[i] for i in range(VOCAB)]).log().to(torch.bfloat16).float().softmax(-1).numpy()
    _check_distribution(tokens, np.where(np.isin(np.arange(VOCAB), [3, 0, 5]), p, 0) / p[[3, 0, 5]].sum())


# ---------------------------------------------------------------------------------------------- seeds
def _run(seeds_and_params: list[tuple[int | None, SamplingParams]], steps: list[torch.Tensor]) -> list[list[int]]:
    """Tokens per step of a batch whose rows use fresh generators from the given seeds."""
    gens = [make_generator(seed, "cpu") for seed, _ in seeds_and_params]
    params = [p for _, p in seeds_and_params]
    return [sample(logits, params, gens).tolist() for logits in steps]


def test_seeded_rows_do_not_depend_on_the_batch():
    vocab = 1000
    base = [torch.randn(1, vocab) for _ in range(6)]
    filler = [torch.randn(4, vocab) for _ in range(6)]
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=5)
    alone = [t[0] for t in _run([(5, sp)], base)]
    batched_steps = [torch.cat([f[:2], b, f[2:]]) for b, f in zip(base, filler)]
    batch = [(None, SamplingParams(temperature=1.0)), (11, SamplingParams(temperature=0.7, min_p=0.05)),
             (5, sp), (None, SamplingParams(temperature=0)), (3, SamplingParams(temperature=1.3, top_k=50))]
    together = _run(batch, batched_steps)
    assert [t[2] for t in together] == alone
    assert _run([(5, sp)], base) == [[t] for t in alone]  # reproducible
    other = [t[0] for t in _run([(6, sp)], base)]
    assert other != alone  # and the seed matters (6 steps over ~200 candidates)


def test_seeded_rows_leave_the_default_rng_alone():
    logits = torch.randn(2, 100)
    state = torch.get_rng_state()
    sample(logits, [SamplingParams(temperature=1.0)] * 2, [make_generator(1, "cpu"), make_generator(2, "cpu")])
    assert torch.equal(torch.get_rng_state(), state)
    sample(logits, [SamplingParams(temperature=1.0)] * 2, [make_generator(1, "cpu"), None])
    assert not torch.equal(torch.get_rng_state(), state)


def test_unseeded_rows_follow_the_default_rng():
    logits = torch.randn(8, 500)
    params = [SamplingParams(temperature=1.0)] * 8
    torch.manual_seed(3)
    a = sample(logits, params, [None] * 8)
    torch.manual_seed(3)
    assert torch.equal(sample(logits, params, [None] * 8), a)


def test_make_generator():
    assert make_generator(None, "cpu") is None
    g1, g2 = make_generator(-1, "cpu"), make_generator(2**64 - 1, "cpu")
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))  # -1 wraps to 2**64 - 1
    assert make_generator(2**70 + 5, "cpu").initial_seed() == 5
    with pytest.raises(TypeError, match="seed must be an integer"):
        make_generator("7", "cpu")


# ---------------------------------------------------------------------------------------------- property
@st.composite
def _cases(draw):
    vocab = draw(st.integers(2, 24))
    values = draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab, unique=True))
    logits = torch.tensor(values, dtype=torch.float32) * 0.25  # distinct, gaps >= 0.25: no ties at a top-k cut
    params = SamplingParams(temperature=draw(st.sampled_from([0.3, 1.0, 2.5])), top_k=draw(st.integers(-1, vocab + 2)),
                            top_p=draw(st.floats(0.05, 1.0)), min_p=draw(st.sampled_from([0.0, 0.05, 0.3, 0.8])))
    return logits, params


def _surely_dropped(logits: torch.Tensor, p: SamplingParams, eps: float = 1e-4) -> set[int]:
    """Tokens the filters drop by a margin (float64 reference from the definitions)."""
    z = logits.double() / p.temperature
    order = z.argsort(descending=True).tolist()
    keep = order[: p.top_k] if p.top_k > 0 else order
    dropped = set(order) - set(keep)
    probs = torch.softmax(z[keep], 0).tolist()
    mass, nucleus = 0.0, []
    for token, prob in zip(keep, probs):
        if mass >= p.top_p + eps:
            dropped.add(token)
        elif mass < p.top_p - eps or p.top_p == 1:
            nucleus.append((token, prob))
        else:
            return dropped  # too close to the top-p boundary to tell what min-p sees
        mass += prob
    top = max(prob for _, prob in nucleus)  # min-p is relative to the top token, so renormalising changes nothing
    dropped |= {t for t, prob in nucleus if prob < p.min_p * top * (1 - eps)}
    return dropped


@settings(max_examples=60, deadline=None)
@given(_cases())
def test_never_samples_a_filtered_token(case):
    logits, params = case
    rows = 64
    out = sample(logits.expand(rows, -1), [params] * rows, [None] * rows)
    assert not set(out.tolist()) & _surely_dropped(logits, params)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(seed="7"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(n=0), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(RequestRejected, match=rf"SamplingParams: {field} "):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="END", temperature=0)
    assert p.stop == ["END"] and p.stop_token_ids == [] and p.greedy
    assert not SamplingParams().greedy


def test_sample_rejects_bad_inputs():
    logits = torch.randn(2, 10)
    with pytest.raises(ValueError, match="as many SamplingParams and generators"):
        sample(logits, [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"must be \[batch, vocab\]"):
        sample(logits[0], [SamplingParams()], [None])
    with pytest.raises(TypeError, match="floating point"):
        sample(logits.long(), [SamplingParams()] * 2, [None] * 2)


def test_sample_does_not_modify_logits():
    logits = torch.randn(4, 30)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1)] * 4, [None] * 4)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------- logits processing
def _reference_processing(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int],
                          eos: set[int]) -> np.ndarray:
    """vLLM's definitions, one token at a time in float64."""
    x = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            if t < len(x):  # stop ids outside the vocabulary cannot be sampled anyway
                x[t] = -np.inf
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    for t in range(len(x)):
        count = output.count(t)
        if t in prompt or count:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def test_process_logits_matches_the_definitions_row_by_row():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=g) * 3
    rows = [  # (params, prompt, output)
        (SamplingParams(repetition_penalty=1.7), [3, 3, 9, 39], [1, 9, 9]),
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4), [2, 4], [5, 5, 5, 6, 2]),
        (SamplingParams(temperature=1.0), [1], [2]),  # no processing: untouched
        (SamplingParams(min_tokens=3, stop_token_ids=[7, 99], logit_bias={0: 5.0, 8: -100}), [1, 2], [4, 4]),
        (SamplingParams(min_tokens=2, ignore_eos=True, repetition_penalty=0.5, presence_penalty=1.0), [0], [0, 1]),
    ]
    params = [r[0] for r in rows]
    histories = [TokenHistory(prompt, output) for _, prompt, output in rows]
    eos = {11, 12}
    got = process_logits(logits.clone(), params, histories, eos)
    for i, (p, prompt, output) in enumerate(rows):
        want = _reference_processing(logits[i].numpy(), p, prompt, output, eos)
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], logits[2])
    assert torch.isinf(got[3, [7, 11, 12]]).all() and not torch.isinf(got[4]).any()  # ignore_eos keeps EOS open


@given(ops=st.lists(st.one_of(st.integers(0, 39), st.just(-1)), max_size=200))
@settings(max_examples=40, deadline=None)
def test_penalties_follow_outputs_that_grow_between_steps(ops):
    """A history copies only the tokens added since the last step (``TokenHistory.output_array``): through appends,
    its buffer's growth and a cut list read before it grows again (-1: drop the last half), each step's penalties
    equal the definitions over the whole output so far."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 40, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.2),
              SamplingParams(presence_penalty=0.7, logit_bias={1: 2.0})]
    outputs = [[k % 40 for k in range(70)], [5]]  # 70: the buffer grows (by copying what it holds) past 70
    histories = [TokenHistory([3, 4], outputs[0]), TokenHistory([], outputs[1])]
    assert histories[0].output_array().tolist() == outputs[0]
    for k, op in enumerate(ops):
        out = outputs[k % 2]
        if op < 0:
            del out[len(out) // 2:]
        else:
            out.append(op)
        assert histories[k % 2].output_array().tolist() == out
        if k % 7 == 0 or k == len(ops) - 1:
            got = process_logits(logits.clone(), params, histories)
            for i, h in enumerate(histories):
                want = _reference_processing(logits[i].numpy(), params[i], list(h.prompt_ids), outputs[i], set())
                np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-6, atol=1e-6)


def test_greedy_rows_pick_the_argmax_of_processed_logits():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0]] * 3)
    params = [SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(temperature=0, min_tokens=1),
              SamplingParams(temperature=0, logit_bias={3: 6.0})]
    histories = [TokenHistory([0], []), TokenHistory([2], []), TokenHistory([2], [])]
    out = sample(logits, params, [None] * 3, histories, eos_token_ids={0})
    assert out.tolist() == [1, 1, 3]  # 4/2 < 3.9; EOS 0 masked until a token exists; +6 lifts token 3
    with pytest.raises(ValueError, match="TokenHistory"):
        sample(logits, params, [None] * 3)


def test_penalties_change_sampled_distributions_as_defined():
    # presence penalty ln(2) on token 3 halves its odds: probabilities proportional to PROBS with p[3] / 2
    rows = 20_000
    p = SamplingParams(temperature=1.0, presence_penalty=math.log(2))
    out = sample(known_logits(rows), [p] * rows, [None] * rows, [TokenHistory([], [3])] * rows).numpy()
    expected = np.array([PROBS[i] for i in range(VOCAB)])
    expected[3] /= 2
    _check_distribution(out, expected / expected.sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-46),  # would be 0 in fp32: greedy
    SamplingParams(temperature=1e-5 / 2),
    SamplingParams(temperature=1.0, top_p=1e-50),  # rounds to 0 in fp32: the top token stays
    SamplingParams(temperature=1.0, min_p=1.0),  # keeps only the top token
    SamplingParams(temperature=0.7, top_k=1, top_p=1e-30, min_p=1.0),
])
def test_underflowing_sampling_is_greedy(params):
    logits = torch.randn(32, 500) * 5
    assert torch.equal(sample(logits, [params] * 32, [make_generator(i, "cpu") for i in range(32)]),
                       logits.argmax(-1))


def test_non_finite_probabilities_fall_back_to_argmax():
    logits = torch.randn(4, 50)
    logits[0, 7] = torch.inf  # inf - inf = NaN after the max shift
    logits[1] = torch.nan
    logits[2, :] = -torch.inf  # nothing possible at all
    params = [SamplingParams(temperature=1.0)] * 3 + [SamplingParams(temperature=1e300)]  # overflows fp32
    out = sample(logits, params, [None] * 4)
    assert out[0] == 7 and 0 <= out[1] < 50 and 0 <= out[2] < 50 and 0 <= out[3] < 50
    huge = sample(torch.randn(2000, 6) * 3, [SamplingParams(temperature=1e300)] * 2000, [None] * 2000)
    assert len(set(huge.tolist())) == 6  # a huge temperature is uniform, not argmax


def test_token_logprobs_are_log_softmax_with_ranks():
    logits = (torch.randn(6, 30) * 2).to(torch.bfloat16)
    tokens = torch.tensor([0, 5, 29, 3, 3, 17])
    chosen, rank, top_lp, top_ids = token_logprobs(logits, tokens, 4)
    reference = logits.float().log_softmax(-1)
    assert torch.allclose(chosen, reference[torch.arange(6), tokens])
    assert rank.tolist() == [int((reference[i] >= reference[i, t]).sum()) for i, t in enumerate(tokens.tolist())]
    assert torch.equal(top_ids, reference.topk(4).indices) and torch.allclose(top_lp, reference.topk(4).values)
    assert token_logprobs(logits, tokens, 0)[2].shape == (6, 0)
