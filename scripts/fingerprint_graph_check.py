# SPDX-License-Identifier: Apache-2.0
"""fingerprint.HeldFingerprints on a GPU: the same sums as fingerprinting one
tensor at a time, from the call that captures its CUDA graph on, also after
the tensors' values change in place (the graph reads them where they are),
and without giving back what PyTorch holds cached (a trainer's send buffer);
and how long each call takes.

    python3 scripts/fingerprint_graph_check.py
"""

import sys
import time

import torch

sys.path.insert(0, ".")
from proof import fingerprint as d

torch.manual_seed(0)
ts = [
    torch.randn(64, 2048, 1408, dtype=torch.bfloat16, device="cuda"),
    torch.randn(2048, device="cuda"),
    torch.randn(7, 129, dtype=torch.bfloat16, device="cuda"),
] + [torch.randn(2048, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(400)]
cached = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
del cached  # as a trainer's freed send buffer
reserved = torch.cuda.memory_reserved()
h = d.HeldFingerprints()
for i in range(4):
    if i == 3:
        ts[0][5, 7, 9] += 1
        ts[1][3] = 0.5
    torch.cuda.synchronize()
    s = time.perf_counter()
    got = h(ts)
    t = time.perf_counter() - s
    want = d.exact_fingerprints(ts)
    print(f"call {i}: graph={h._graph is not None} same={got == want} {t * 1e3:.2f} ms", flush=True)
    assert got == want
    assert torch.cuda.memory_reserved() >= reserved, "the capture emptied PyTorch's cache"
torch.cuda.synchronize()
s = time.perf_counter()
d.exact_fingerprints(ts)
print(f"eager {1e3 * (time.perf_counter() - s):.2f} ms")
print("graph ok")
