from __future__ import annotations

import json

import pytest

from kiln.bench.datasets import load_dataset, load_requests


class WordTokenizer:
    """One token per whitespace-separated word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}


def test_sharegpt_json(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "a b c d e"},
                           {"from": "gpt", "value": "1 2 3 4 5 6"}]},
        {"conversations": [{"from": "human", "value": "too short"},
                           {"from": "gpt", "value": "1 2 3 4"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn at all"}]},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = load_requests(p, WordTokenizer(), 10)
    assert len(reqs) == 1
    assert len(reqs[0].prompt_token_ids) == 5 and reqs[0].output_len == 6


def test_jsonl_and_overrides(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": "w " * n, "output_len": 8}) for n in (4, 5, 6)))
    assert len(load_requests(p, WordTokenizer(), 2)) == 2
    reqs = load_requests(p, WordTokenizer(), 10, output_len=16, max_seq_len=21)
    assert sorted(len(r.prompt_token_ids) for r in reqs) == [4, 5]
    assert all(r.output_len == 16 for r in reqs)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_requests(tmp_path / "missing.json", WordTokenizer(), 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1"):
        load_requests(bad, WordTokenizer(), 1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "a b c d"}) + "\n")
    with pytest.raises(ValueError, match="no usable prompts"):
        load_requests(empty, WordTokenizer(), 1)


def test_every_record_runs_unless_num_prompts_says_otherwise(tmp_path):
    """No request count: every usable record of the file (5 here, no default's number); the
    file's record count and the skipped ones are reported."""
    p = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": "w " * (4 + i), "output_len": 4 + i}) for i in range(5)]
    p.write_text("\n".join([*lines, json.dumps({"prompt": "too short", "output_len": 8})]))
    f = load_dataset(p, WordTokenizer())
    assert len(f.requests) == 5 and f.num_records == 6 and f.num_skipped == 1
    assert sorted(r.output_len for r in f.requests) == [4, 5, 6, 7, 8]
    assert len(load_requests(p, WordTokenizer())) == 5
    assert len(load_dataset(p, WordTokenizer(), 3).requests) == 3
    with pytest.raises(ValueError, match="num_prompts=0"):
        load_dataset(p, WordTokenizer(), 0)
