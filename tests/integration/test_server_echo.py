"""`kiln serve` /v1/completions with echo, prompt logprobs and max_tokens 0: how
lm-evaluation-harness' ``local-completions`` scores loglikelihoods (``echo``, ``logprobs: 1``,
``max_tokens: 1``, ``temperature: 0``, token-id prompts).

A real server over the tiny random float32 llama reference engine; scores are checked
against transformers' float32 forward over the same tokens, atol 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess

ATOL = 1e-4
PROMPT = "The quick brown fox jumps"
IDS = [ord(ch) for ch in PROMPT]  # the byte tokenizer: one token per ASCII character


@pytest.fixture(scope="module")
def tiny(tiny_reference):
    return tiny_reference("llama")


@pytest.fixture(scope="module")
def client(tiny):
    with ServerProcess(tiny[1], "--served-model-name", "tiny") as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ref(tiny) -> torch.Tensor:
    """[len(IDS) - 1, vocab]: transformers' logprobs of each next prompt token."""
    with torch.no_grad():
        logits = tiny[0](torch.tensor([IDS])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def post(client, **body):
    r = client.post("/v1/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _check_prompt_scores(lp: dict, ref: torch.Tensor, text: str) -> None:
    n = len(IDS)
    assert "".join(lp["tokens"][:n]) == text[:len(PROMPT)] == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        want = ref[p - 1, IDS[p]].item()
        assert abs(lp["token_logprobs"][p] - want) <= ATOL, (p, lp["token_logprobs"][p], want)
        top = lp["top_logprobs"][p]
        best = ref[p - 1].argmax().item()
        assert list(top) == [chr(best)] if best < 128 else len(top) == 1
        assert abs(next(iter(top.values())) - ref[p - 1, best].item()) <= ATOL
        # lm-eval's is_greedy: the token's logprob equals the best alternative's exactly
        assert (lp["token_logprobs"][p] == max(top.values())) == (best == IDS[p])
    offsets = lp["text_offset"]
    assert offsets[:n] == list(range(n))
    assert [text[o : o + len(t)] for o, t in zip(offsets, lp["tokens"])] == lp["tokens"]


@pytest.mark.parametrize("prompt", [IDS, PROMPT], ids=["token-ids", "text"])
def test_echo_logprobs_score_the_prompt(client, ref, prompt):
    out = post(client, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    c = out["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT) and len(lp["tokens"]) == len(IDS) + 1
    _check_prompt_scores(lp, ref, c["text"])
    assert out["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": 1,
                            "total_tokens": len(IDS) + 1}
    # the completion is the one without echo
    plain = post(client, prompt=prompt, max_tokens=1, logprobs=1, temperature=0)["choices"][0]
    assert c["text"] == PROMPT + plain["text"]
    # (the same up to float32 rounding: the scoring step's lm_head ran over more rows)
    assert abs(lp["token_logprobs"][-1] - plain["logprobs"]["token_logprobs"][0]) <= ATOL


def test_max_tokens_0_echoes_the_prompt_alone(client, ref):
    out = post(client, prompt=IDS, max_tokens=0, logprobs=1, echo=True)
    c = out["choices"][0]
    assert c["text"] == PROMPT and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(IDS)
    _check_prompt_scores(c["logprobs"], ref, c["text"])
    assert out["usage"]["completion_tokens"] == 0
    plain = post(client, prompt=PROMPT, max_tokens=0, echo=True)["choices"][0]
    assert plain["text"] == PROMPT and plain["logprobs"] is None


def test_max_tokens_0_without_echo_is_a_400(client):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"], err


def test_prompt_logprobs_shape(client, ref):
    c = post(client, prompt=IDS, max_tokens=2, prompt_logprobs=2,
             temperature=0)["choices"][0]
    assert "prompt_logprobs" in c and c["logprobs"] is None and not c["text"].startswith("T")
    pl = c["prompt_logprobs"]
    assert len(pl) == len(IDS) and pl[0] is None
    for p in range(1, len(IDS)):
        entry = pl[p]
        own = entry[str(IDS[p])]
        assert abs(own["logprob"] - ref[p - 1, IDS[p]].item()) <= ATOL
        assert own["rank"] == 1 + int((ref[p - 1] > ref[p - 1, IDS[p]]).sum())
        assert own["decoded_token"] == PROMPT[p]
        vals, idx = ref[p - 1].topk(2)
        for rank, (t, v) in enumerate(zip(idx.tolist(), vals.tolist()), start=1):
            assert entry[str(t)]["rank"] == rank and abs(entry[str(t)]["logprob"] - v) <= ATOL
        assert len(entry) in (2, 3)  # the token itself, unless one of the two alternatives
    # without prompt_logprobs the choice has no such key
    assert "prompt_logprobs" not in post(client, prompt=IDS, max_tokens=1)["choices"][0]


def test_streaming_echo(client):
    body = {"model": "tiny", "prompt": [PROMPT, "abc"], "n": 2, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 1,
            "prompt_logprobs": 0, "stream": True}
    chunks = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    full = post(client, **{k: v for k, v in body.items() if k != "stream"})
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == want["index"]]
        first = mine[0]
        prompt = PROMPT if want["index"] < 2 else "abc"
        assert first["text"].startswith(prompt)
        assert len(first["prompt_logprobs"]) == len(prompt)
        assert first["logprobs"]["token_logprobs"][0] is None
        assert all("prompt_logprobs" not in c for c in mine[1:])
        assert "".join(c["text"] for c in mine) == want["text"]
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert tokens == want["logprobs"]["tokens"]
        # the completion's offsets point past the echoed prompt (streamed ones may lag
        # where the detokenizer holds back an incomplete character)
        n = len(prompt)
        assert offsets[:n] == want["logprobs"]["text_offset"][:n] == list(range(n))
        assert all(o >= n for o in offsets[n:])
        assert want["prompt_logprobs"] == first["prompt_logprobs"]



def test_chat_prompt_logprobs(client, tiny):
    """vLLM's chat prompt_logprobs: on the response, per rendered prompt token, equal to
    transformers over the same tokens."""
    messages = [{"role": "user", "content": "hello there"}]
    ids = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "prompt_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    scores = r.json()["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(tiny[0](torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        entry = scores[p]
        assert 1 <= len(entry) <= 3
        assert abs(entry[str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) <= ATOL
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
