# SPDX-License-Identifier: Apache-2.0
"""A server-side fault for the GPU run of `scripts/with_worker.py stale_block_worker.StaleBlockWorker ...`: from
the second sync on, DP engine 0's direct loader leaves the first expert block
of each sync as it was (stale), as a loader bug would. The exact check must
name that parameter and that engine; nothing else in the run changes."""

from proof.exact_check_engine import ExactCheckWorker
from weight_sync import direct_load

_copies = direct_load._copies


class StaleBlockWorker(ExactCheckWorker):
    def direct_load_start(self, in_place: str | dict = "") -> dict:
        self._syncs = getattr(self, "_syncs", 0) + 1
        stale = self._syncs >= 2 and self.vllm_config.parallel_config.data_parallel_rank == 0
        skipped = []

        def copies(session, tensors, trainer_rank):
            found = _copies(session, tensors, trainer_rank)
            blocks = found.blocks or found.fp8_blocks  # in the order of the tensors
            if stale and not skipped and blocks:
                layers = session.layout.expert_layers
                skipped.append(next(n for n, _ in tensors if n.rpartition(".")[0] in layers))
                blocks.pop(0)
                print(f"[stale_block_worker] sync {self._syncs}: left {skipped[0]} as it was", flush=True)
            return found

        direct_load._copies = copies
        self._in_place_copies = None  # work the copies out again, through `copies`
        return super().direct_load_start(in_place)  # (which copies the experts held in place)
