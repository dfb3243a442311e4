"""GPU check of gemv's FP8_ALU_WIDEN: every e4m3 byte but NaN, widened on the integer ALUs,
equals torch's float32 conversion (one-hot x picks column 0; e4m3 is exact in bf16), at
every one-row config; then the relative error of real-shape GEMVs against float32.

    PYTHONPATH=.:scripts python3 scripts/alu_widen_check.py
"""

from __future__ import annotations

import torch

from kiln.runtime.kernels import gemv

DEV = "cuda"


def main() -> None:
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # no NaN
    n = codes.numel()
    w = torch.zeros(n, 1024, dtype=torch.uint8)
    w[:, 0] = codes
    w = w.to(DEV).view(torch.float8_e4m3fn)
    x = torch.zeros(1, 1024, device=DEV, dtype=torch.bfloat16)
    x[0, 0] = 1.0
    one = torch.ones((), device=DEV)
    want = w[:, 0].float()
    for cfg in [None, *gemv.GEMV_CONFIGS[:9]]:
        for alu in (0, 1, 2):
            gemv.FP8_ALU_WIDEN = alu
            got = gemv.gemv(x, w, one, config=cfg).float()[0]
            bad = (got != want).sum().item()
            print(f"alu={alu} config={cfg}: {bad} of {n} codes differ", flush=True)
            assert bad == 0, (got[got != want], want[got != want])
    torch.manual_seed(0)
    for name, (nn, k) in {"qkv": (6144, 4096), "down": (4096, 14336)}.items():
        wr = (torch.randn(nn, k, device=DEV) * k**-0.5 * 64).to(torch.float8_e4m3fn)
        s = torch.tensor(1 / 64, device=DEV)
        xr = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        outs = []
        for alu in (0, 1, 2):
            gemv.FP8_ALU_WIDEN = alu
            outs.append(gemv.gemv(xr, wr, s).float())
        print(f"{name}: alu vs cvt max abs diff {(outs[0] - outs[-1]).abs().max().item():.3e} "
              f"(bit-equal expected)", flush=True)
        assert all(torch.equal(outs[0], o) for o in outs)
    print("ALU widening: all checks passed")


if __name__ == "__main__":
    main()
