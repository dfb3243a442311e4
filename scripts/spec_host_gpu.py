"""Lookahead (7,7,7) on smollm2 bf16, one code prompt: tok/s with async scheduling on / off,
then where the host time of the speculative steps goes (cProfile, top by own time)."""
import cProfile, io, pstats, tempfile, time
from pathlib import Path
import torch
from kiln.bench.prompts import CODE_PROMPTS
from kiln.builder import build_engine
from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

out = Path(tempfile.mkdtemp()) / "smol"
build_engine("smollm2-135m", out, dtype="bfloat16", max_seq_len=1024, max_num_tokens=4096,
             max_batch_size=8, progress=False,
             speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cuda"))
prompt = eng.apply_chat_template([{"role": "user", "content": CODE_PROMPTS[0]}])
def run(window, n=256):
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lookahead=window)
    torch.cuda.synchronize(); t = time.perf_counter()
    o = eng.generate([prompt], p)[0]
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t), o.metrics.num_steps
run((7, 7, 7), 32); run((1, 1, 0), 32)
for a in (True, False):
    eng.async_scheduling = a
    print(f"async={a}: plain {run((1, 1, 0))}, lookahead {run((7, 7, 7))}")
eng.async_scheduling = True
pr = cProfile.Profile(); pr.enable(); r = run((7, 7, 7)); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
print(r); print(s.getvalue()[-5000:])
