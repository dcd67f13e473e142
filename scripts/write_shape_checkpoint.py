# SPDX-License-Identifier: Apache-2.0
"""Write a preset's shape as a real checkpoint on disk (to measure
loading the default path's way, a checkpoint, without a download).

    python scripts/write_shape_checkpoint.py qwen3-30b-a3b-shape /root/ckpt [--time-full-read]

The preset's config.json and tokenizer (models.build_preset), and random bf16
weights under the names and in the layout `save_pretrained` writes
(sources.CheckpointForm of the model on the meta device: per-expert
tensors for Qwen3-MoE), drawn on the GPU (std 1/sqrt(fan-in), norms 1), in
safetensors files of about 5 GB with an index. --time-full-read then times
what the trainer's load did before the per-rank read: one process reading the
whole checkpoint into CPU memory with from_pretrained.
"""

import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from weight_sync import models, sources  # noqa: E402

FILE_BYTES = 5 * 10**9


def main(preset: str, out: str, time_full_read: bool) -> None:
    path = models.build_preset(preset, out)
    form = sources.CheckpointForm(models.meta_model(path), torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start, files, batch, batch_bytes, weight_map, total = time.perf_counter(), 0, {}, 0, {}, 0

    def flush() -> None:
        nonlocal files, batch, batch_bytes
        name = f"model-{files:05d}.safetensors"
        save_file(batch, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(batch, name))
        files, batch, batch_bytes = files + 1, {}, 0

    for name, shape, dtype in form.metadata:
        std = 1.0 if "norm" in name or "embed_tokens" in name else shape[-1] ** -0.5
        t = torch.ones(shape, dtype=dtype) if "norm" in name else torch.randn(shape, device=device).mul_(std)
        batch[name] = t.to(dtype).cpu()
        total, batch_bytes = total + batch[name].nbytes, batch_bytes + batch[name].nbytes
        if batch_bytes >= FILE_BYTES:
            flush()
    if batch:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(
        f"[write] {len(weight_map)} tensors, {total / 1e9:.1f} GB in {files} files at {path}, "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    if time_full_read:
        from transformers import AutoModelForCausalLM

        start = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        print(
            f"[full read] from_pretrained of the whole checkpoint into CPU memory: {time.perf_counter() - start:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--time-full-read" in sys.argv)
