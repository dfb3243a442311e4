"""Detokenizer: special tokens leave the text unless a request keeps them."""

from __future__ import annotations

from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.request import Request
from kiln.runtime.sampling_params import SamplingParams
from kiln.sources.tokenizer import BYTE_EOS_ID, make_byte_tokenizer

IM_START = 258  # <|im_start|>, a special token of the byte tokenizer


def _text(skip: bool) -> str:
    tok = make_byte_tokenizer()
    detok = Detokenizer(tok)
    req = Request("r", list(b"hi"), SamplingParams(skip_special_tokens=skip), (BYTE_EOS_ID,))
    detok.init_request(req)
    for t in [*b"ok ", IM_START, *b"go"]:
        req.append_token(t)
        detok.update(req)
    return req.text


def test_special_tokens_dropped_by_default_kept_on_request():
    assert _text(skip=True) == "ok go"
    assert _text(skip=False) == "ok <|im_start|>go"
