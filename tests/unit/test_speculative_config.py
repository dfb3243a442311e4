"""Build-time speculative settings: formula, triples, CLI validation, limits, request windows."""

from __future__ import annotations

import pytest

from kiln.artifact.speculative import (
    SpeculativeConfig,
    check_limits,
    max_draft_len,
    parse_window,
    tokens_per_step,
    triples_for,
    validate_request_window,
)

LA = SpeculativeConfig.from_cli("lookahead", "5,5,5", None, None)


@pytest.mark.parametrize(
    "wng,length",
    [((4, 3, 4), 15), ((5, 5, 5), 39), ((7, 7, 7), 83), ((15, 5, 15), 119), ((1, 1, 0), 0),
     ((2, 2, 1), 2), ((3, 3, 2), 9)],
)
def test_max_draft_len_formula(wng, length):
    assert max_draft_len(*wng) == length
    assert tokens_per_step(*wng) == length + 1
    w, n, g = wng
    if n > 1:
        assert tokens_per_step(*wng) == (w + g) * (n - 1)


def test_triples_for():
    ts = triples_for(39)
    assert ts[0] == (5, 5, 5)
    assert (10, 3, 10) in ts and (20, 2, 20) in ts
    assert len(ts) == 6 and len(set(ts)) == 6
    for length in (1, 2, 15, 39, 83, 119):
        got = triples_for(length, limit=50)
        assert got and all(max_draft_len(*t) == length for t in got)
    assert triples_for(15)[0] == (4, 3, 4)
    assert triples_for(83)[0] == (7, 7, 7)
    assert triples_for(0) == [(1, 1, 0)]
    assert triples_for(39, limit=2) == [(5, 5, 5), (4, 6, 4)]


def test_from_cli_lookahead_derives_and_round_trips():
    c = SpeculativeConfig.from_cli("lookahead", "5,5,5", None, None)
    assert (c.mode, c.max_draft_len, c.lookahead, c.tokens_per_step) == (
        "lookahead", 39, (5, 5, 5), 40)
    assert SpeculativeConfig.from_cli("lookahead", "4, 3, 4", 15, None).max_draft_len == 15
    d = c.to_dict()
    assert d["lookahead"] == [5, 5, 5] and d["max_draft_len"] == 39
    assert SpeculativeConfig.from_dict(d) == c
    plain = SpeculativeConfig(mode="none", max_draft_len=0, lookahead=None)
    assert SpeculativeConfig.from_dict(plain.to_dict()) == plain == SpeculativeConfig()
    assert plain.tokens_per_step == 1 and not plain.enabled
    assert SpeculativeConfig.from_cli("none", None, None, None) == plain


def test_field_report_max_draft_len_alone_fails_at_build():
    # trtllm-build --speculative_decoding_mode lookahead_decoding --max_draft_len 39
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_cli("lookahead", None, 39, None)
    msg = str(e.value)
    assert "--max-draft-len 39" in msg
    assert "(N-2 if N>1 else 0) + (W-1+G)*(N-1)" in msg
    assert "(5,5,5)" in msg and "--lookahead-config" in msg


def test_disagreeing_flags_fail_naming_both_sides():
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_cli("lookahead", "4,3,4", 39, None)
    msg = str(e.value)
    assert "--max-draft-len 39" in msg and "(4,3,4)" in msg and "needs 15" in msg
    assert "(W-1+G)*(N-1)" in msg and "(5,5,5)" in msg and "give 39" in msg


@pytest.mark.parametrize(
    "cfg,match",
    [
        ("5,5", "malformed"),
        ("a,b,c", "malformed"),
        ("5,5,5,5", "malformed"),
        ("0,5,5", "W and N must be >= 1 and G >= 0"),
        ("5,0,5", "W and N must be >= 1"),
        ("5,5,-1", "G >= 0"),
        ("2,1,0", "N == 1 .* requires W == 1 and G == 0"),
        ("1,1,3", "N == 1"),
    ],
)
def test_bad_lookahead_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_cli("lookahead", cfg, None, None)
    with pytest.raises(ValueError, match=match):
        parse_window(cfg)


def test_mode_rules():
    with pytest.raises(ValueError, match="'eagle' is unknown: valid modes are none, lookahead"):
        SpeculativeConfig.from_cli("eagle", None, None, None)
    with pytest.raises(ValueError, match="speculative decoding needs beam width 1"):
        SpeculativeConfig.from_cli("lookahead", "5,5,5", None, None, beam_width=4)
    with pytest.raises(ValueError, match="pass --speculative-decoding-mode lookahead"):
        SpeculativeConfig.from_cli("none", "5,5,5", None, None)
    with pytest.raises(ValueError, match="--max-draft-len given but .* mode is 'none'"):
        SpeculativeConfig.from_cli("none", None, 15, None)
    # no window named: the measured default, (7,7,7), max_draft_len derived from it
    default = SpeculativeConfig.from_cli("lookahead", None, None, None)
    assert (default.lookahead, default.max_draft_len) == ((7, 7, 7), 83)
    assert default == SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None)
    with pytest.raises(ValueError, match="\\(1,1,0\\) is plain decoding"):
        SpeculativeConfig.from_cli("lookahead", "1,1,0", None, None)
    # TensorRT-LLM spelling is accepted
    assert SpeculativeConfig.from_cli("lookahead_decoding", "4,3,4", None, None).lookahead == (
        4, 3, 4)
    # beam width > 1 is fine without speculation
    assert SpeculativeConfig.from_cli("none", None, None, None, beam_width=4).mode == "none"


def test_ngram_mode():
    c = SpeculativeConfig.from_cli("ngram", None, 4, 3)
    assert (c.mode, c.max_draft_len, c.ngram_max_match, c.ngram_min_match) == ("ngram", 4, 3, 1)
    assert c.lookahead is None and c.tokens_per_step == 5
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="max_draft_len >= 1"):
        SpeculativeConfig.from_cli("ngram", None, None, None)
    with pytest.raises(ValueError, match="max_draft_len >= 1"):
        SpeculativeConfig.from_cli("ngram", None, 0, None)
    with pytest.raises(ValueError, match="--ngram-match 0"):
        SpeculativeConfig.from_cli("ngram", None, 4, 0)
    with pytest.raises(ValueError, match="applies to mode 'lookahead'"):
        SpeculativeConfig.from_cli("ngram", "5,5,5", 4, None)


def test_lookahead_records_the_prompt_lookup_candidates_match():
    """--ngram-match also sizes lookahead's prompt-lookup candidate (default 3)."""
    c = SpeculativeConfig.from_cli("lookahead", "7,7,7", None, 5)
    assert (c.mode, c.lookahead, c.ngram_max_match, c.ngram_min_match) == \
        ("lookahead", (7, 7, 7), 5, 1)
    assert SpeculativeConfig.from_dict(c.to_dict()) == c
    assert SpeculativeConfig.from_cli("lookahead", "7,7,7").ngram_max_match == 3
    with pytest.raises(ValueError, match="--ngram-match 0"):
        SpeculativeConfig.from_cli("lookahead", "7,7,7", None, 0)


def test_constructor_rejects_inconsistent_records():
    with pytest.raises(ValueError, match="does not match lookahead \\(4,3,4\\), which needs 15"):
        SpeculativeConfig(mode="lookahead", max_draft_len=39, lookahead=(4, 3, 4))
    with pytest.raises(ValueError, match="records no \\(W,N,G\\) window"):
        SpeculativeConfig(mode="lookahead", max_draft_len=39)
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig(mode="medusa")
    # engine.json stores lists; from_dict and the constructor both accept them
    assert SpeculativeConfig(mode="lookahead", max_draft_len=15, lookahead=[4, 3, 4]).lookahead == (
        4, 3, 4)


def test_check_limits():
    kw = dict(max_batch_size=4, max_seq_len=250, max_input_len=200, max_num_tokens=1000)
    assert check_limits(LA, **kw) == []
    with pytest.raises(ValueError, match="max_num_tokens 39 .* >= 1 \\+ max_draft_len = 40"):
        check_limits(LA, **{**kw, "max_num_tokens": 39})
    with pytest.raises(ValueError, match="max_seq_len 230 .* 200 \\+ 40 = 240, 10 more"):
        check_limits(LA, **{**kw, "max_seq_len": 230})
    warns = check_limits(LA, **{**kw, "max_batch_size": 64})
    assert len(warns) == 1 and "64 x 40 tokens per step = 2560 exceeds max_num_tokens 1000" in (
        warns[0])
    assert check_limits(SpeculativeConfig(), max_batch_size=512, max_seq_len=10,
                        max_input_len=9, max_num_tokens=8) == []


def test_validate_request_window():
    assert validate_request_window(LA, 5, 5, 5) == (5, 5, 5)
    assert validate_request_window(LA, 2, 3, 0) == (2, 3, 0)
    assert validate_request_window(LA, 1, 1, 0) == (1, 1, 0)
    for bad in [(6, 5, 5), (5, 6, 5), (5, 5, 6), (0, 5, 5), (5, 5, -1)]:
        with pytest.raises(ValueError, match="exceeds the engine window \\(5,5,5\\)") as e:
            validate_request_window(LA, *bad)
        assert "({},{},{})".format(*bad) in str(e.value)
    with pytest.raises(ValueError, match="N == 1"):
        validate_request_window(LA, 3, 1, 0)
    plain = SpeculativeConfig()
    assert validate_request_window(plain, 1, 1, 0) == (1, 1, 0)
    with pytest.raises(ValueError, match="mode 'none', so only \\(1,1,0\\)"):
        validate_request_window(plain, 2, 2, 1)
    ngram = SpeculativeConfig.from_cli("ngram", None, 4, None)
    with pytest.raises(ValueError, match="mode 'ngram'"):
        validate_request_window(ngram, 2, 2, 1)


def test_device_speculation_defaults_to_prompt_lookup_on_cuda(monkeypatch):
    """Unset, speculative state goes on the device for prompt-lookup engines on CUDA only
    (where it was measured to win); KILN_DEVICE_SPECULATION / RuntimeConfig force it."""
    import torch

    from kiln.runtime.config import RuntimeConfig
    from kiln.runtime.startup import device_speculation_on

    monkeypatch.delenv("KILN_DEVICE_SPECULATION", raising=False)
    ngram = SpeculativeConfig.from_cli("ngram", None, 8, 3)
    la = SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = RuntimeConfig()
    assert auto.device_speculation is None
    assert device_speculation_on(auto, ngram, cuda)
    assert not device_speculation_on(auto, ngram, cpu)
    assert not device_speculation_on(auto, la, cuda)
    assert device_speculation_on(RuntimeConfig(device_speculation=True), la, cpu)
    assert not device_speculation_on(RuntimeConfig(device_speculation=False), ngram, cuda)
    monkeypatch.setenv("KILN_DEVICE_SPECULATION", "0")
    assert not device_speculation_on(RuntimeConfig(), ngram, cuda)
    monkeypatch.setenv("KILN_DEVICE_SPECULATION", "1")
    assert device_speculation_on(RuntimeConfig(), la, cuda)
