# SPDX-License-Identifier: Apache-2.0
"""On a GPU: where the direct loader's FP8 kernel and vLLM's per_block_cast_to_fp8
(which vLLM compiles with torch.compile) differ, element by element, on a
Moonlight-shape expert block: the element, its block's scale, and what each way
of computing element / scale gives before and after the e4m3 cast.

    python scripts/fp8_diff_probe.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from weight_sync import fp8_experts  # noqa: E402

generator = torch.Generator(device="cuda").manual_seed(0)
block = (torch.randn((64, 2816, 2048), generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
want_w, want_s = fp8_experts.fp8_reference(block, 2)
got_w, got_s = torch.empty_like(want_w), torch.empty_like(want_s)
fp8_experts._launch_fp8_blocks(block, 2, got_w, got_s)
differ = (got_w.view(torch.uint8) != want_w.view(torch.uint8)).nonzero()
print(f"{len(differ)} of {want_w.numel()} bytes differ; scales identical: {torch.equal(got_s, want_s)}")
for e, r, c in differ[:8].tolist():
    scale, x = want_s[e, r // 128, c // 128].view(1), block[e, r, c].float().view(1)
    times_reciprocal, divided = x * (1.0 / scale), x / scale
    print(
        f"x {x.item()!r} scale {scale.item()!r}: x*(1/scale) {times_reciprocal.item()!r} -> "
        f"{times_reciprocal.to(torch.float8_e4m3fn).float().item()}, x/scale {divided.item()!r} -> "
        f"{divided.to(torch.float8_e4m3fn).float().item()}; vLLM's {want_w[e, r, c].float().item()}, "
        f"the kernel's {got_w[e, r, c].float().item()}"
    )
