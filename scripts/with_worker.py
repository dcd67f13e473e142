# SPDX-License-Identifier: Apache-2.0
"""Run the script (or benchmark.py) with the server's direct loader replaced by
another worker extension, for fault runs on a GPU: a class from tests/ that
derives from exact_check_engine.ExactCheckWorker (the direct loader with the exact check).

    python scripts/with_worker.py stale_block_worker.StaleBlockWorker --model tiny --num-gpus 1 --train --rounds 2
    python scripts/with_worker.py fault_worker.FaultWorker --model tiny --num-gpus 1 --rounds 3
    python scripts/with_worker.py swapped_experts_worker.SwappedExpertsWorker --model tiny-qwen2-moe --num-gpus 1 \
        --weight-loader vllm --rounds 2
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))

import rlhf_ipc_fsdp_ep as script  # noqa: E402

WORKER = sys.argv.pop(1)
_serve_args = script.serve_args


def serve_args_with_the_worker(*args, **kwargs):
    flags = _serve_args(*args, **kwargs)
    flags[flags.index("proof.exact_check_engine.ExactCheckWorker")] = WORKER
    return flags


script.serve_args = serve_args_with_the_worker

if __name__ == "__main__":
    script.program.cli(script.main)
