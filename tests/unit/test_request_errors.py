"""Every raise site of a request's own mistake raises a RequestError naming its param."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from kiln.artifact.speculative import SpeculativeConfig, validate_request_window
from kiln.errors import RequestError
from kiln.runtime.engine import LLMEngine
from kiln.runtime.guided import GuidedSpec
from kiln.runtime.sampling_params import SamplingParams

VOCAB = 100


def _engine() -> SimpleNamespace:
    """Just what add_request reads before it queues anything."""
    return SimpleNamespace(tokenizer=None, model_config=SimpleNamespace(vocab_size=VOCAB),
                           limits=SimpleNamespace(max_input_len=8), _ids=itertools.count(),
                           _requests={"taken": object()})


def _add(prompt, params=None, request_id=None):
    return lambda: LLMEngine.add_request(_engine(), prompt, params, request_id)


LOOKAHEAD = SpeculativeConfig(mode="lookahead", max_draft_len=39, lookahead=(5, 5, 5))
NONE = SpeculativeConfig()

CASES = [
    # SamplingParams.__post_init__
    ("max_tokens", lambda: SamplingParams(max_tokens=0)),
    ("temperature", lambda: SamplingParams(temperature=-1)),
    ("temperature", lambda: SamplingParams(temperature=float("nan"))),
    ("top_p", lambda: SamplingParams(top_p=0)),
    ("min_p", lambda: SamplingParams(min_p=2)),
    ("repetition_penalty", lambda: SamplingParams(repetition_penalty=0)),
    ("frequency_penalty", lambda: SamplingParams(frequency_penalty=3)),
    ("presence_penalty", lambda: SamplingParams(presence_penalty=-3)),
    ("logit_bias", lambda: SamplingParams(logit_bias=((1, 101.0),))),
    ("seed", lambda: SamplingParams(seed=2**64)),
    ("stop_token_ids", lambda: SamplingParams(stop_token_ids=(-1,))),
    ("logprobs", lambda: SamplingParams(logprobs=21)),
    ("stop", lambda: SamplingParams(stop=("",))),
    ("lookahead", lambda: SamplingParams(lookahead=(1, 1))),
    # LLMEngine.add_request
    ("prompt", _add([])),
    ("prompt", _add([VOCAB])),
    ("prompt", _add(list(range(9)))),
    ("stop_token_ids", _add([1], SamplingParams(stop_token_ids=(VOCAB,)))),
    ("logit_bias", _add([1], SamplingParams(logit_bias=((VOCAB, 1.0),)))),
    ("request_id", _add([1], request_id="taken")),
    # the request's lookahead window against the engine's
    ("lookahead", lambda: validate_request_window(NONE, 5, 5, 5)),
    ("lookahead", lambda: validate_request_window(LOOKAHEAD, 6, 5, 5)),
    ("lookahead", lambda: validate_request_window(LOOKAHEAD, 2, 1, 0)),
]


@pytest.mark.parametrize("param, call", CASES)
def test_request_error_names_its_param(param, call):
    with pytest.raises(RequestError) as info:
        call()
    assert info.value.param == param
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_grammar_errors_name_no_param():
    """The compiler cannot know which request field held the grammar; the server does."""
    pytest.importorskip("xgrammar")
    from kiln.runtime.guided.xgrammar_backend import XGrammarCompiler
    from kiln.sources import make_byte_tokenizer

    compiler = XGrammarCompiler(make_byte_tokenizer(), 512)
    for spec in (GuidedSpec("json_schema", "{not json"), GuidedSpec("grammar", "root ::= ")):
        with pytest.raises(RequestError) as info:
            compiler.compiled(spec)
        assert info.value.param is None
