# SPDX-License-Identifier: Apache-2.0
"""A server-side fault for the GPU run of `scripts/with_worker.py stale_block_worker.StaleBlockWorker ...`: from
the second sync on, DP engine 0's direct loader leaves the first expert block
of each sync as it was (stale), as a loader bug would. The exact check must
name that parameter and that engine; nothing else in the run changes."""

from proof.exact_check_engine import ExactCheckWorker
from weight_sync import direct_load

_copy_local_experts = direct_load._copy_local_experts


class StaleBlockWorker(ExactCheckWorker):
    def direct_load_start(self, in_place: str | dict = "") -> dict:
        self._syncs = getattr(self, "_syncs", 0) + 1
        stale = self._syncs >= 2 and self.vllm_config.parallel_config.data_parallel_rank == 0
        skipped = []

        def copy(experts, name, *args):
            if stale and not skipped:
                skipped.append(name)
                print(f"[stale_block_worker] sync {self._syncs}: left {name} as it was", flush=True)
                return
            _copy_local_experts(experts, name, *args)

        direct_load._copy_local_experts = copy
        return super().direct_load_start(in_place)  # (which copies the experts held in place)
