"""`kiln build --tp` and `kiln generate` of a tp-2 engine through the real console entry
point: the ranks start, answer as the tp-1 engine does, and are gone afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from test_cli_build import kiln

from kiln.builder import build_engine


def _workers_of(engine: Path) -> list[str]:
    """Command lines of live processes running a rank of ``engine``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "kiln.runtime.parallel.worker" in cmd and str(engine) in cmd:
            found.append(cmd)
    return found


def test_generate_on_a_tp2_engine_matches_tp1_and_leaves_no_rank(tiny_hf_model, tmp_path):
    src = str(tiny_hf_model("qwen2"))
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    build_engine(src, one, dtype="float32", max_seq_len=128, progress=False, tune=False)
    r = kiln("build", src, "-o", str(two), "--tp", "2", "--dtype", "float32", "--max-seq-len",
             "128", "--no-tune", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["parallel"]["shards"] == [
        "weights-rank0-of-2.safetensors", "weights-rank1-of-2.safetensors"]
    args = ("hello there", "--raw", "--device", "cpu", "--temperature", "0", "--max-tokens",
            "12", "--ignore-eos", "--json")
    want = kiln("generate", str(one), *args)
    got = kiln("generate", str(two), *args)
    assert want.returncode == 0, want.stderr
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]
    assert len(json.loads(got.stdout)["token_ids"]) == 12
    assert _workers_of(two) == []


def test_build_error_names_the_heads_and_the_tp_values_that_work(tmp_path):
    r = kiln("build", "random:smollm2-135m", "-o", str(tmp_path / "e"), "--tp", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --tp 2: num_attention_heads=9 is not divisible by tp=2")
    assert "splits with --tp 1, 3" in r.stderr
    assert not (tmp_path / "e").exists()
