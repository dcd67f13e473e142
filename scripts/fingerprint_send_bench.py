# SPDX-License-Identifier: Apache-2.0
"""What fingerprinting a sync's tensors costs on one GPU, without vLLM: the
Moonlight-16B-A3B shape's 350 bf16 tensors (31.9 GB; random values), through
the exact check's fingerprint one tensor at a time (as the trainer does in the
send), from one CUDA graph (exact_check_engine.HeldFingerprints, as the engine does),
against one copy of every tensor and a pack into a 4 GB buffer (what the send
itself does to each weight). Medians of 5 after a warm-up; JSON to ./trainer_fp.json.

    python3 scripts/fingerprint_send_bench.py
"""

import json
import sys
import time

import torch

sys.path.insert(0, ".")
from proof import fingerprint as d  # noqa: E402

H, L = 2048, 27
shapes = [(163840, H), (163840, H), (H,)]
shapes += [(3072, H), (576, H), (512,), (4096, 512), (H, H), (H,), (H,), (11264 * 2, H), (H, 11264)]
for _ in range(L - 1):
    shapes += [
        (3072, H),
        (576, H),
        (512,),
        (4096, 512),
        (H, H),
        (H,),
        (H,),
        (64, H),
        (64, 2816, H),
        (64, H, 1408),
        (5632, H),
        (H, 2816),
    ]
ts = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes] + [
    torch.randn(64, device="cuda") for _ in range(L - 1)
]
gb = sum(t.numel() * t.element_size() for t in ts) / 1e9
out = {"tensors": len(ts), "gb": gb, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def timed(fn, n=5):
    fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(time.perf_counter() - s)
    return sorted(best)[n // 2]


out["eager_per_tensor_s"] = timed(lambda: torch.stack(d.exact_fingerprint_sums(ts)).cpu())


def enqueue_only():
    s = time.perf_counter()
    d.exact_fingerprint_sums(ts)
    e = time.perf_counter() - s
    torch.cuda.synchronize()
    return e


enqueue_only()
out["eager_enqueue_cpu_s"] = sorted(enqueue_only() for _ in range(5))[2]
h = d.HeldFingerprints()
h(ts)
h(ts)
out["graph_s"] = timed(lambda: h(ts))
out["copy_all_s"] = timed(lambda: [t.to(torch.bfloat16, copy=True) for t in ts])
big = torch.empty(int(4e9), dtype=torch.uint8, device="cuda")


def pack():
    off = 0
    for t in ts:
        n = t.numel() * t.element_size()
        if off + n > big.numel():
            off = 0
        big[off : off + n].copy_(t.view(-1).view(torch.uint8))
        off += n


out["pack_copy_s"] = timed(pack)
print(json.dumps(out, indent=1))
json.dump(out, open("trainer_fp.json", "w"), indent=1)
