"""The exact check on a real GPU, against a fault on the engine side: the
script, with the server's direct loader replaced by tests/stale_block_worker.py
(DP engine 0 leaves one expert block stale from the second sync on). Run with
--train so the second sync changes that block; expect exit 1 and
`FAILED: round 2: exact check: DP engine 0: ...w13_weight...`.

    PYTHONPATH=tests python scripts/gpu_stale_block.py --model tiny --num-gpus 1 --train --rounds 2
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import rlhf_ipc_fsdp_ep as script  # noqa: E402

_serve_args = script.serve_args


def serve_args_with_a_stale_block(*args, **kwargs):
    flags = _serve_args(*args, **kwargs)
    flags[flags.index("direct_load.DirectLoadWorker")] = "stale_block_worker.StaleBlockWorker"
    return flags


script.serve_args = serve_args_with_a_stale_block

if __name__ == "__main__":
    script.cli(script.main)
