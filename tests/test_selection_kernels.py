"""Selection ops (Quest page scores, OmniKV token scores, top-k select): references against naive loops,
Triton kernels (interpreter on CPU) against the references at toy sizes, and torch.library.opcheck."""

from __future__ import annotations

import pytest
import torch

from sparsecompile.kernels import omnikv_scores, quest_page_scores, topk_select
from sparsecompile.kernels.library import triton_available
from sparsecompile.kernels.omnikv_scores import omnikv_scores_reference
from sparsecompile.kernels.quest_scores import quest_page_scores_reference
from sparsecompile.kernels.topk_select import topk_select_reference

POOL, HEADS, GROUP, PAGE, DIM = 12, 2, 3, 4, 8
triton_only = pytest.mark.skipif(not triton_available(), reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _quest_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(POOL, HEADS, DIM, generator=g)
    kmax = kmin + torch.rand(POOL, HEADS, DIM, generator=g)
    query = torch.randn(3, HEADS * GROUP, DIM, generator=g)
    pages = torch.stack([torch.randperm(POOL, generator=g)[:5] for _ in range(3)]).to(torch.int32)
    num = torch.tensor([5, 2, 1])
    return query, kmin, kmax, pages, num


def _naive_quest(query, kmin, kmax, pages, num):
    out = torch.full((query.shape[0], HEADS, pages.shape[1]), float("-inf"), dtype=torch.float64)
    for b in range(query.shape[0]):
        for h in range(HEADS):
            for j in range(int(num[b])):
                p = int(pages[b, j])
                per_head = [sum(max(float(query[b, qh, c] * kmin[p, h, c]), float(query[b, qh, c] * kmax[p, h, c]))
                                for c in range(DIM)) for qh in range(h * GROUP, (h + 1) * GROUP)]
                out[b, h, j] = max(per_head)  # GQA: max over the group's query heads
    return out


def test_quest_scores_match_formula():
    case = _quest_case()
    got = quest_page_scores(*case)
    assert got.shape == (3, HEADS, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _naive_quest(*case), atol=1e-5, rtol=1e-5)


def test_quest_score_bounds_every_logit_and_groups_by_max():
    """The page score upper-bounds q.k of every key in the page; a page only one query head likes ranks first."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(POOL, HEADS, PAGE, DIM, generator=g)
    kmin, kmax = keys.amin(2), keys.amax(2)
    query = torch.randn(1, HEADS * GROUP, DIM, generator=g)
    pages = torch.arange(POOL, dtype=torch.int32)[None]
    scores = quest_page_scores(query, kmin, kmax, pages, torch.tensor([POOL]))
    logits = torch.einsum("hgd,phsd->hgps", query[0].view(HEADS, GROUP, DIM), keys)  # [h, g, page, slot]
    assert (scores[0] + 1e-5 >= logits.amax(dim=(1, 3))).all()
    # Page 0: high for query head 0 only; page 1: moderately high for the two other heads of the group.
    kmin2, kmax2 = torch.zeros(2, 1, 2), torch.zeros(2, 1, 2)
    kmax2[0, 0, 0] = kmin2[0, 0, 0] = 6.0
    kmax2[1, 0, 1] = kmin2[1, 0, 1] = 4.0
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])  # 3 query heads, one KV head
    s = quest_page_scores(q, kmin2, kmax2, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2]))
    assert s[0, 0].tolist() == [6.0, 4.0]  # max over the group: page 0 first (a sum, 6 vs 8, would pick page 1)


def test_omnikv_scores_match_naive():
    g = torch.Generator().manual_seed(1)
    k_pool = torch.randn(POOL, HEADS, PAGE, DIM, generator=g)
    query = torch.randn(2, HEADS * GROUP, DIM, generator=g)
    pages = torch.tensor([[3, 7, 1], [0, 11, 5]], dtype=torch.int32)
    limit = torch.tensor([9, 4])
    got = omnikv_scores(query, k_pool, pages, limit)
    assert got.shape == (2, 3 * PAGE)
    for b in range(2):
        for j in range(3 * PAGE):
            if j >= int(limit[b]):
                assert got[b, j] == float("-inf")
                continue
            page, off = int(pages[b, j // PAGE]), j % PAGE
            want = max(float(query[b, qh] @ k_pool[page, qh // GROUP, off]) for qh in range(HEADS * GROUP))
            assert abs(float(got[b, j]) - want) < 1e-5


def _naive_topk(scores, counts, k):
    out = torch.full((*scores.shape[:2], k), -1, dtype=torch.int64)
    for b in range(scores.shape[0]):
        for h in range(scores.shape[1]):
            row = scores[b, h].tolist()
            order = sorted(range(len(row)), key=lambda i: (-row[i], i))  # ties: lower index first
            keep = sorted(order[:max(0, min(int(counts[b, h]), k, len(row)))])
            out[b, h, :len(keep)] = torch.tensor(keep, dtype=torch.int64)
    return out


def _topk_case(n, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(2, 3, n, generator=g)
    scores[0, 0, : min(5, n)] = 0.5  # ties
    scores[1, 1, n // 2] = float("inf")
    scores[1, 2, -2:] = float("-inf")
    return scores


@pytest.mark.parametrize("n,k", [(13, 5), (9, 12), (40, 40)])
def test_topk_select_reference_matches_naive(n, k):
    scores = _topk_case(n, n)
    counts = torch.tensor([[0, 3, k], [1, k + 4, 2]])
    got = topk_select(scores, counts, k)
    assert got.shape == (2, 3, k) and got.dtype == torch.int64
    assert torch.equal(got, _naive_topk(scores, counts, k))


def test_opcheck_selection_ops():
    torch.library.opcheck(torch.ops.sparsecompile.quest_page_scores.default, _quest_case())
    k_pool = torch.randn(POOL, HEADS, PAGE, DIM)
    pages = torch.tensor([[3, 7], [0, 1]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.sparsecompile.omnikv_scores.default,
                          (torch.randn(2, HEADS * GROUP, DIM), k_pool, pages, torch.tensor([5, 8])))
    torch.library.opcheck(torch.ops.sparsecompile.topk_select.default,
                          (torch.randn(2, 3, 10), torch.tensor([[1, 2, 3], [0, 10, 4]]), 6))
    pools = [torch.randn(POOL + 1, HEADS, PAGE, DIM), torch.randn(POOL + 1, HEADS, PAGE, DIM),
             torch.zeros(POOL + 1, HEADS, PAGE, dtype=torch.int32)]
    for tokens, slots in ((3, [[0, 1, -1], [PAGE * 2, -1, -1]]), (1, [[PAGE + 3], [-1]])):
        torch.library.opcheck(torch.ops.sparsecompile.kv_write_bounds.default,
                              (*pools, torch.randn(POOL + 1, HEADS, DIM), torch.randn(POOL + 1, HEADS, DIM),
                               torch.randn(2, HEADS, tokens, DIM), torch.randn(2, HEADS, tokens, DIM),
                               torch.tensor(slots), torch.arange(2 * tokens).view(2, tokens)))


def test_kv_write_bounds_resets_first_slots_and_folds_the_rest():
    from sparsecompile.kernels import kv_write_bounds, kv_write_reference

    pools = [torch.zeros(POOL + 1, HEADS, PAGE, DIM), torch.zeros(POOL + 1, HEADS, PAGE, DIM),
             torch.zeros(POOL + 1, HEADS, PAGE, dtype=torch.int32)]
    want = [t.clone() for t in pools]
    kmin, kmax = torch.zeros(POOL + 1, HEADS, DIM), torch.zeros(POOL + 1, HEADS, DIM)
    key, value = torch.randn(1, HEADS, 3, DIM), torch.randn(1, HEADS, 3, DIM)
    slots, positions = torch.tensor([[PAGE * 2, PAGE * 2 + 1, -1]]), torch.tensor([[4, 5, 6]])
    kv_write_bounds(*pools, kmin, kmax, key, value, slots, positions)
    kv_write_reference(*want, key, value, slots, positions)
    assert all(torch.equal(a, b) for a, b in zip(pools, want))  # the write itself is kv_write's
    assert torch.equal(kmin[2], torch.minimum(key[0, :, 0], key[0, :, 1]))  # the stale zeros were reset
    assert torch.equal(kmax[2], torch.maximum(key[0, :, 0], key[0, :, 1]))
    assert torch.equal(kmin[:2], torch.zeros(2, HEADS, DIM)) and torch.equal(kmin[3:POOL], torch.zeros(POOL - 3, HEADS,
                                                                                                      DIM))


@triton_only
def test_triton_quest_scores_match_reference():
    from sparsecompile.kernels.quest_scores import quest_page_scores_triton

    case = [t.to(DEVICE) for t in _quest_case(5)]
    torch.testing.assert_close(quest_page_scores_triton(*case), quest_page_scores_reference(*case),
                               atol=1e-5, rtol=1e-5)


def _affine_case(bits=2, seed=6, groups=2, group=4):
    """KIVI key pages of ``groups`` quantization groups (``kivi_quant``'s formulas): zeros / scales ``[POOL, HEADS,
    groups, DIM]`` and the dequantized keys ``[POOL, HEADS, groups * group, DIM]`` they bound; a constant channel."""
    from sparsecompile.kernels.kivi_quant import dequantize_keys, quantize_keys

    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(POOL, HEADS, groups, group, DIM, generator=g) * torch.linspace(0.5, 3, DIM)
    keys[0, 1, 0, :, 2] = 0.75
    codes, scale, zero = quantize_keys(keys, bits, torch.float16)
    return zero, scale, dequantize_keys(codes, scale, zero).flatten(2, 3)


@pytest.mark.parametrize("bits", [2, 4])
def test_affine_scores_are_quest_scores_of_the_dequantized_keys(bits):
    """A KIVI key group spans exactly [zero, zero + levels * scale] per channel (its extremes quantize to codes 0 and
    levels): the scores from the metadata equal Quest's over the dequantized keys' per-page min / max, and bound
    every logit of the page."""
    from sparsecompile.kernels.quest_scores import quest_page_scores_affine

    zero, scale, keys = _affine_case(bits)
    query, _, _, pages, num = _quest_case(1)
    levels = 2 ** bits - 1
    got = quest_page_scores_affine(query, zero, scale, pages, num, levels)
    torch.testing.assert_close(got, quest_page_scores_reference(query, keys.amin(2), keys.amax(2), pages, num),
                               atol=1e-5, rtol=1e-5)
    logits = torch.einsum("bhgd,phsd->bhgps", query.view(3, HEADS, GROUP, DIM), keys).amax(dim=(2, 4))  # [b, h, p]
    for b in range(3):
        for j in range(int(num[b])):
            assert (got[b, :, j] + 1e-5 >= logits[b, :, int(pages[b, j])]).all()
        assert torch.isinf(got[b, :, int(num[b]):]).all()
    torch.library.opcheck(torch.ops.sparsecompile.quest_page_scores_affine.default,
                          (query, zero, scale, pages, num, levels))


@triton_only
@pytest.mark.parametrize("groups", [1, 2])
def test_triton_affine_scores_match_reference(groups):
    from sparsecompile.kernels.quest_scores import quest_page_scores_affine_reference, quest_page_scores_triton

    zero, scale, _ = _affine_case(groups=groups)
    query, _, _, pages, num = _quest_case(2)
    case = [t.to(DEVICE) for t in (query, zero, scale, pages, num)]
    torch.testing.assert_close(quest_page_scores_triton(*case, levels=3),
                               quest_page_scores_affine_reference(*case, 3), atol=1e-3, rtol=1e-3)


@triton_only
def test_triton_omnikv_scores_match_reference():
    from sparsecompile.kernels.omnikv_scores import omnikv_scores_triton

    g = torch.Generator().manual_seed(2)
    k_pool = torch.randn(POOL, HEADS, PAGE, DIM, generator=g).to(DEVICE)
    query = torch.randn(2, HEADS * GROUP, DIM, generator=g).to(DEVICE)
    pages = torch.tensor([[3, 7, 1, 4, 2], [0, 11, 5, 6, 8]], dtype=torch.int32, device=DEVICE)
    limit = torch.tensor([17, 6], device=DEVICE)
    torch.testing.assert_close(omnikv_scores_triton(query, k_pool, pages, limit),
                               omnikv_scores_reference(query, k_pool, pages, limit), atol=1e-5, rtol=1e-5)


@triton_only
@pytest.mark.parametrize("search", ["bisect", "bit", "byte"])
@pytest.mark.parametrize("n,k", [(13, 5), (9, 12), (70, 16)])
def test_triton_topk_select_matches_reference(n, k, search):
    from sparsecompile.kernels.topk_select import topk_select_triton

    scores = _topk_case(n, n + 1).to(DEVICE)
    counts = torch.tensor([[0, 3, k], [1, k + 4, 2]], device=DEVICE)
    got = topk_select_triton(scores, counts, k, search=search)
    assert torch.equal(got, topk_select_reference(scores, counts, k))


@triton_only
@pytest.mark.parametrize("levels", [1, 3, 40, None])
def test_triton_topk_select_ties_match_reference(levels):
    """One value everywhere, heavy ties (3 levels), some (40) and none: every search keeps the reference's set
    (ties to the lower index), whatever the counts."""
    from sparsecompile.kernels.topk_select import topk_select_triton

    g = torch.Generator().manual_seed(7)
    n, k = 200, 64
    scores = torch.randn(4, 5, n, generator=g)
    if levels is not None:
        scores = torch.randint(0, levels, (4, 5, n), generator=g).float() - levels / 2
    counts = torch.randint(0, k + 8, (4, 5), generator=g)
    counts[0, :3] = torch.tensor([0, 1, n])
    want = topk_select_reference(scores, counts, k)
    for search in ("bisect", "bit", "byte"):
        got = topk_select_triton(scores.to(DEVICE), counts.to(DEVICE), k, search=search)
        assert torch.equal(got.cpu(), want), search


@pytest.mark.parametrize("n,k,levels", [(13, 5, None), (9, 12, None), (70, 16, None), (300, 40, None), (300, 40, 3),
                                          (300, 40, 40)])
def test_long_row_topk_select_matches_reference(n, k, levels):
    """The torch path for rows longer than a Triton tile: same kept set, order, tie rule (ties: 3 or 40 levels, the
    count inside the top level or below several) and padding."""
    from sparsecompile.kernels.topk_select import _topk_select_long

    scores = _topk_case(n, n + 1)
    if levels is not None:
        scores = torch.randint(0, levels, scores.shape, generator=torch.Generator().manual_seed(n)).float()
    scores[1, 0, : n // 2] = float("-inf")  # fewer finite entries than some counts ask for
    scores[0, 2, 3] = float("inf")
    counts = torch.tensor([[0, 3, k], [n, k + 4, 2]])
    got = _topk_select_long(scores, counts, k)
    assert got.is_contiguous()  # the op's fake (meta) output is contiguous: compiled graphs rely on it
    assert torch.equal(got, topk_select_reference(scores, counts, k))


@triton_only
@pytest.mark.parametrize("n,k,chunk,levels", [(300, 40, 64, 40), (70, 16, 16, 2), (9, 12, 16, None)])
def test_radix_topk_select_matches_reference(n, k, chunk, levels):
    """The many-program select for long rows (radix passes with atomic histograms, then ordered per-chunk writes):
    same kept set, order, tie rule and padding; ties spread over several chunks (40 levels), the count inside one
    of two levels, a row shorter than the width."""
    from sparsecompile.kernels.topk_select import topk_select_radix

    scores = _topk_case(n, n + 2)
    if levels is not None:
        scores = torch.randint(0, levels, scores.shape, generator=torch.Generator().manual_seed(n)).float()
    scores[1, 0, : n // 2] = float("-inf")
    scores[0, 2, 3] = float("inf")
    counts = torch.tensor([[0, 3, k], [n, k + 4, 2]])
    got = topk_select_radix(scores.to(DEVICE), counts.to(DEVICE), k, chunk=chunk)
    assert torch.equal(got.cpu(), topk_select_reference(scores, counts, k))


@triton_only
def test_radix_from_routes_rows_within_the_tile(monkeypatch):
    """``RADIX_FROM``: rows of at least that many scores take the radix select inside one program's tile too (Quest's
    rows, if the H200 says so); shorter rows keep the one-program select."""
    import importlib

    module = importlib.import_module("sparsecompile.kernels.topk_select")
    calls = []
    radix = module.topk_select_radix
    monkeypatch.setattr(module, "topk_select_radix", lambda *a, **kw: calls.append(a[0].shape[-1]) or radix(*a, **kw))
    monkeypatch.setattr(module, "RADIX_FROM", 200)
    for n in (300, 100):
        scores = _topk_case(n, n + 2)
        counts = torch.tensor([[0, 3, 16], [n, 20, 2]])
        got = module.topk_select_triton(scores.to(DEVICE), counts.to(DEVICE), 16)
        assert torch.equal(got.cpu(), topk_select_reference(scores, counts, 16))
    assert calls == [300]


@triton_only
@pytest.mark.parametrize("kv_heads,tokens", [(2, 1), (3, 1), (2, 3)])
def test_triton_kv_write_bounds_matches_reference(kv_heads, tokens):
    """One key per sequence (the fused decode kernel): a page's first slot resets its bounds, later slots fold in,
    padding (-1) writes nothing; a non-power-of-two head count is masked. Several (prefill): the torch update."""
    from sparsecompile.kernels.kv_write import kv_write_bounds_reference, kv_write_bounds_triton

    g = torch.Generator().manual_seed(kv_heads)
    pools = [torch.randn(POOL + 1, kv_heads, PAGE, DIM, generator=g), torch.randn(POOL + 1, kv_heads, PAGE, DIM,
                                                                                 generator=g),
             torch.zeros(POOL + 1, kv_heads, PAGE, dtype=torch.int32)]
    kmin = torch.randn(POOL + 1, kv_heads, DIM, generator=g)
    kmax = kmin + torch.rand(POOL + 1, kv_heads, DIM, generator=g)
    key = torch.randn(4, kv_heads, tokens, DIM, generator=g)
    value = torch.randn(4, kv_heads, tokens, DIM, generator=g)
    first = torch.tensor([[PAGE * 3], [PAGE * 5 + 2], [-1], [PAGE * 7 + PAGE - 1]])
    slots = torch.where(first >= 0, first + torch.arange(tokens) * PAGE, -1)  # a page per token: no order to keep
    positions = torch.arange(4 * tokens).view(4, tokens)
    want = [t.clone() for t in (*pools, kmin, kmax)]
    kv_write_bounds_reference(*want, key, value, slots, positions)
    got = [t.to(DEVICE) for t in (*pools, kmin, kmax)]
    kv_write_bounds_triton(*got, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), positions.to(DEVICE))
    real = torch.arange(POOL)  # the trash page (last) holds whatever padding left there
    for a, b in zip(got, want):
        assert torch.equal(a.cpu()[real], b[real])
    assert torch.equal(got[3].cpu()[3], key[0, :, 0])  # reset, not folded into the stale bounds


@triton_only
def test_triton_quest_scores_with_three_kv_heads():
    from sparsecompile.kernels.quest_scores import quest_page_scores_triton

    g = torch.Generator().manual_seed(11)
    kmin = torch.randn(POOL, 3, DIM, generator=g)
    kmax = kmin + torch.rand(POOL, 3, DIM, generator=g)
    query = torch.randn(2, 3 * GROUP, DIM, generator=g)
    pages = torch.stack([torch.randperm(POOL, generator=g)[:7] for _ in range(2)]).to(torch.int32)
    case = (query, kmin, kmax, pages, torch.tensor([7, 3]))
    torch.testing.assert_close(quest_page_scores_triton(*(t.to(DEVICE) for t in case)).cpu(),
                               quest_page_scores_reference(*case), atol=1e-5, rtol=1e-5)
