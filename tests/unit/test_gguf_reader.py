"""kiln's GGUF reader and name mapping on small files written with gguf.GGUFWriter (no
download): metadata, tensor table, dequantization equal to gguf.quants.dequantize,
llama.cpp's q/k permutation undone, truncated and corrupt files named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.errors import SourceError
from kiln.sources.gguf import _unpermute, gguf_hf_config, hf_name
from kiln.sources.gguf_reader import TensorData, read_header

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]],
           **meta) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(320)])
    w.add_array("kiln.test.ints", [1, 2, 3])
    for k, v in meta.items():
        w.add_string(k, v)
    for name, (data, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, data)
        else:
            q = quantize(data, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path):
    g = np.random.default_rng(0)
    q8, q50 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0
    tensors = {
        "token_embd.weight": (g.standard_normal((320, 64), dtype=np.float32), q8),
        "blk.0.attn_q.weight": (g.standard_normal((64, 64), dtype=np.float32), q50),
        "blk.0.attn_q.bias": (g.standard_normal(64, dtype=np.float32), None),
        "blk.0.attn_norm.weight": (np.ones(64, np.float32), None),
    }
    return _write(tmp_path / "small.gguf", "qwen2", tensors, **{"kiln.test.s": "héllo"}), tensors


def test_header_metadata_and_tensor_table(small):
    path, tensors = small
    h = read_header(path)
    md = h.metadata
    assert md["general.architecture"] == "qwen2" and md["qwen2.block_count"] == 1
    assert md["tokenizer.ggml.tokens"] == 320  # string arrays: their length only
    assert md["kiln.test.ints"] == [1, 2, 3] and md["kiln.test.s"] == "héllo"
    assert list(h.tensors) == list(tensors)
    assert h.tensors["token_embd.weight"].shape == (320, 64)  # torch order
    assert h.tensors["blk.0.attn_q.bias"].shape == (64,)


def test_dequantize_equals_gguf_package(small):
    path, tensors = small
    reader = gguf.GGUFReader(str(path))
    data = TensorData(read_header(path))
    for t in reader.tensors:
        ours = data.dequantize(t.name)
        ref = dequantize(t.data, t.tensor_type).reshape(ours.shape)
        assert ours.dtype == np.float32 and np.array_equal(ours, ref), t.name
        np.testing.assert_allclose(ours, tensors[t.name][0], atol=0.25)  # and near the source (5-bit steps)


def test_config_from_metadata(small):
    hf = gguf_hf_config(read_header(small[0]))
    assert hf["model_type"] == "qwen2" and hf["vocab_size"] == 320
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (4, 2, 16)
    assert hf["rope_theta"] == 1e6 and hf["attention_bias"]
    assert hf["tie_word_embeddings"]  # no output.weight


def test_unpermute_inverts_llama_cpp_permute():
    g = np.random.default_rng(1)
    for n_head, shape in ((4, (64, 32)), (2, (32, 32)), (4, (64,))):
        w = g.standard_normal(shape).astype(np.float32)
        assert np.array_equal(_unpermute(_llama_cpp_permute(w, n_head), n_head), w)


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") == "blk.0.ffn_gate_exps.weight"  # unknown


def test_truncated_and_corrupt_files_are_named(small, tmp_path):
    path, _ = small
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(SourceError, match=r"cut\.gguf is truncated or corrupt"):
        read_header(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(raw[:200])  # cut inside the metadata
    with pytest.raises(SourceError, match=r"head\.gguf is not a readable GGUF.*truncated"):
        read_header(head)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(SourceError, match="bad.gguf.*GGML"):
        read_header(bad)


def test_unsupported_architecture_is_named(tmp_path):
    p = _write(tmp_path / "m.gguf", "mamba", {"x.weight": (np.ones((4, 32), np.float32), None)})
    with pytest.raises(SourceError, match=r"architecture 'mamba' is not supported"):
        gguf_hf_config(read_header(p))
