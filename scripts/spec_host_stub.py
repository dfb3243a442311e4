"""Host time per lookahead (7,7,7) step on CPU: a tiny llama (vocab 512) whose forward is
stubbed by a deterministic next-token rule, on the staged Triton path (TRITON_INTERPRET, graph
buffers) or the torch path. Host work only, no GPU claim.

    python scripts/spec_host_stub.py triton|torch   (from the checkout whose code to time)
"""
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
import torch

sys.path.insert(0, os.getcwd())
from kiln.builder import build_engine
from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

backend = sys.argv[1] if len(sys.argv) > 1 else "triton"
import transformers

from kiln.sources import make_byte_tokenizer

src = Path(tempfile.mkdtemp()) / "src"
cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=2048)
transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(src)
make_byte_tokenizer().save_pretrained(src)
out = Path(tempfile.mkdtemp()) / "e"
build_engine(str(src), out, dtype="float32", max_seq_len=1024, max_num_tokens=512,
             max_batch_size=4, progress=False,
             speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
kw = {"attention_backend": backend}
if backend == "triton":
    kw["cuda_graphs"] = True
eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", num_kv_blocks=256, **kw))
V = 512
def stub(input_ids, positions, cache, meta, logit_rows):
    x = input_ids[logit_rows.long()].long()
    nxt = (x * 7 + 3) % 61 + 100  # a cycle of period <= 61: predictable continuations
    lg = torch.full((len(logit_rows), eng.model_config.vocab_size), -1.0)
    lg[torch.arange(len(x)), nxt] = 1.0
    return lg
eng.model.forward = stub
prompt = [100 + (i * 13) % 61 for i in range(40)]
p = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
eng.generate([prompt], p)
ts = []
for _ in range(3):
    t = time.perf_counter(); o = eng.generate([prompt], p)[0]; ts.append(time.perf_counter() - t)
print(f"{backend}: {min(ts)/o.metrics.num_steps*1e3:.3f} ms host per step, steps {o.metrics.num_steps}, "
      f"spec steps {o.metrics.spec_steps}, tokens/step {len(o.token_ids)/o.metrics.num_steps:.2f}")
