"""kiln quantize reads a GGUF source through kiln's own reader: the transformers model it
calibrates holds exactly the weights transformers' own GGUF path (``gguf_file=``) loads."""

from __future__ import annotations

import warnings

import pytest
import torch

from kiln.errors import KilnError


@pytest.mark.slow
def test_gguf_model_equals_transformers_gguf_loading(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    from kiln.quantize.modelopt_fp8 import gguf_model
    from kiln.sources import open_source

    got = gguf_model(open_source(str(smollm2_gguf), progress=False), smollm2_gguf,
                     torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent),
                                                   gguf_file=smollm2_gguf.name,
                                                   dtype=torch.float32)
    want, have = ref.state_dict(), got.state_dict()
    assert set(have) == set(want)
    assert [k for k in want if not torch.equal(want[k], have[k])] == []
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.tensor([[1, 9, 42, 7, 300]])
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


@pytest.mark.slow
def test_gguf_model_refuses_a_file_that_lacks_a_tensor(smollm2_gguf):
    """Weights are made without initialisation: one the file does not fill must not reach
    calibration as uninitialised memory."""
    from kiln.quantize.modelopt_fp8 import gguf_model
    from kiln.sources import open_source

    source = open_source(str(smollm2_gguf), progress=False)
    full = source.tensors

    def without_a_norm():
        return ((n, t) for n, t in full() if n != "model.layers.3.post_attention_layernorm.weight")

    source.tensors = without_a_norm
    with pytest.raises(KilnError, match="lacks tensors .*layers.3.post_attention_layernorm"):
        gguf_model(source, smollm2_gguf, torch.float32)
