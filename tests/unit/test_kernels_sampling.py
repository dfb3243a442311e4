"""The sampling kernels (greedy argmax / Gumbel-max over split vocabulary) vs torch, on CPU
under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.kernels import sampling


@pytest.fixture(params=[2048, 16], ids=["one-part", "many-parts"])
def block(request, monkeypatch):
    """The shipped block size, and a small one so a short vocabulary spans many programs."""
    monkeypatch.setattr(sampling, "BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_equal_torch_argmax_with_ties_and_masks(block, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100, generator=g).to(dtype)
    x[1, 30] = x[1, 70] = x[1].max() + 1  # a tie across programs: the first one wins
    x[2, 5] = x[2, 6] = x[2].max() + 1  # a tie inside one program
    x[3, :50] = float("-inf")  # masked tokens
    x[4] = 0.0  # all equal: token 0, as torch.argmax
    x[5, 99] = x[5].max() + 1  # the last token
    out = sampling.sample_tokens(x, 0.0, seed=123)
    assert out.dtype == torch.long
    assert out.tolist() == x.float().argmax(-1).tolist()
    assert out.tolist()[1:3] == [30, 5]


def test_rows_that_are_not_finite_give_invalid_token(block):
    """NaN or +inf logits (a broken model or checkpoint) and rows where every token is masked
    must not yield a token id that looks like a choice: -1 (the sampler's INVALID_TOKEN), so
    the engine fails that request alone; greedy and sampled alike, rows beside them
    unchanged."""
    v = 100
    x = torch.randn(6, v)
    x[0] = float("nan")  # every logit NaN
    x[1, 40:] = float("nan")  # NaN from token 40 on
    x[2, :] = float("-inf")
    x[2, 97] = float("nan")  # NaN among masked tokens
    x[3, 63] = float("inf")
    x[4, :] = float("-inf")  # a grammar that allows nothing
    x[5, :50] = float("-inf")  # a normal masked row
    greedy = sampling.sample_tokens(x, 0.0, seed=1)
    assert greedy.tolist() == [-1, -1, -1, -1, -1, int(x[5].argmax())]
    sampled = sampling.sample_tokens(x, 1.0, seed=1)
    assert sampled.tolist()[:5] == [-1] * 5 and sampled[5] >= 50
    ref = sampling.sample_tokens_ref(x, 0.0, torch.zeros_like(x))
    assert ref.tolist() == greedy.tolist()


def test_sampled_rows_follow_the_gumbel_max_rule_and_are_seeded(block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 40, generator=g)
    inv = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.0, 1.0, 1.0, 1.0])
    a = sampling.sample_tokens(x, inv, seed=7)
    assert a.tolist() == sampling.sample_tokens(x, inv, seed=7).tolist()  # same seed, same
    draws = {tuple(sampling.sample_tokens(x, inv, seed=s).tolist()) for s in range(6)}
    assert len(draws) > 1  # other seeds draw otherwise
    for d in draws:  # greedy rows never move
        assert d[0] == x[0].argmax() and d[4] == x[4].argmax()
    # the rule itself, with the noise given: greedy rows argmax, sampled rows noisy argmax
    noise = -torch.log(-torch.log(torch.rand(8, 40, generator=g)))
    ref = sampling.sample_tokens_ref(x, inv, noise)
    assert ref[0] == x[0].argmax() and ref[1] == (x[1] + noise[1]).argmax()
    assert ref[2] == (2 * x[2] + noise[2]).argmax()


def test_sampled_frequencies_match_softmax_and_masked_tokens_never_win():
    """1000 draws of one 6-token distribution (one row per draw, one call; the interpreter
    runs ~100 programs a second): each token's frequency is within 4.5 standard errors of
    softmax(logits * inv_temp). tests/gpu/test_kernels_gpu.py draws 200000."""
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), -1.0, 0.0])
    rows, inv_t = 1000, 0.8
    out = sampling.sample_tokens(logits.expand(rows, -1).contiguous(), inv_t, seed=2026)
    freq = torch.bincount(out, minlength=6).double() / rows
    p = torch.softmax(logits.double() * inv_t, -1)
    se = (p * (1 - p) / rows).sqrt()
    assert freq[3] == 0
    assert ((freq - p).abs() <= 4.5 * se + 1e-12).all(), (freq.tolist(), p.tolist())


def test_per_row_keys_make_a_row_draw_depend_on_its_key_alone():
    """Seeded requests: with int64 per-row Philox keys a row's token depends on its key and
    logits only (not its row, the batch or other keys), and draws over many keys follow
    softmax(logits * inv_temp)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 40, generator=g).expand(6, -1).contiguous()
    keys = torch.tensor([11, 2**40 + 5, 11, 7, 11, 2**61], dtype=torch.int64)
    a = sampling.sample_tokens(x, 1.0, keys)
    assert a[0] == a[2] == a[4]  # one key, one draw, wherever the row sits
    b = sampling.sample_tokens(x[:2], 1.0, torch.tensor([7, 11], dtype=torch.int64))
    assert b.tolist() == [a[3], a[0]]  # the batch around it changes nothing
    assert sampling.sample_tokens(x[:1], 0.0, keys[:1]) == x[0].argmax()  # greedy ignores it
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), -1.0, 0.0])
    rows, inv_t = 1000, 0.8
    out = sampling.sample_tokens(logits.expand(rows, -1).contiguous(), inv_t,
                                 torch.arange(rows, dtype=torch.int64) * 7919 + 2**33)
    freq = torch.bincount(out, minlength=6).double() / rows
    p = torch.softmax(logits.double() * inv_t, -1)
    assert freq[3] == 0
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / rows).sqrt() + 1e-12).all(), freq


def test_bad_arguments_name_the_value():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="inv_temp=-1"):
        sampling.sample_tokens(x, -1.0, seed=0)
    with pytest.raises(ValueError, match="inv_temp=nan"):
        sampling.sample_tokens(x, float("nan"), seed=0)
    with pytest.raises(ValueError, match="seed=-3"):
        sampling.sample_tokens(x, 1.0, seed=-3)
    with pytest.raises(ValueError, match="3 values for 2 rows"):
        sampling.sample_tokens(x, torch.ones(3), seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        sampling.sample_tokens(torch.randn(10, 2).t(), 1.0, seed=0)
    with pytest.raises(ValueError, match="3 keys for 2 rows"):
        sampling.sample_tokens(x, 1.0, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="dtype"):
        sampling.sample_tokens(x.long(), 1.0, seed=0)
    assert sampling.sample_tokens(torch.empty(0, 10), 1.0, seed=0).shape == (0,)
