# SPDX-License-Identifier: Apache-2.0
"""Server-side faults for the GPU fault matrix (scripts/gpu_fault_matrix.py),
chosen by environment variables that the server inherits from the script:

  FAULT_SLOW_CHUNK_S       every chunk of the direct loader waits this long
                           first, so that a signal sent in the send lands in it
  FAULT_FAIL_ONCE_AT_SYNC  in that sync (1 = the first), the direct loader
                           refuses its first chunk, once: the retry path
                           (--send-retries) on a real GPU

Otherwise it is the direct loader, unchanged."""

import os
import time

from proof.exact_check_engine import ExactCheckWorker


class FaultWorker(ExactCheckWorker):
    def direct_load_start(self, in_place: str | dict = "") -> dict:
        # (called by the send's first chunk: a failure here refuses that chunk)
        self._syncs = getattr(self, "_syncs", 0) + 1
        fail_at = int(os.environ.get("FAULT_FAIL_ONCE_AT_SYNC", "0"))
        if self._syncs == fail_at and not getattr(self, "_failed", False):
            self._failed = True
            print(f"[fault_worker] sync {self._syncs}: refusing its first chunk, once", flush=True)
            raise RuntimeError(f"fault_worker: chunk 1 of sync {self._syncs} refused on purpose")
        return super().direct_load_start(in_place)

    def direct_load_chunk(self, payload: str) -> dict:
        time.sleep(float(os.environ.get("FAULT_SLOW_CHUNK_S", "0")))
        return super().direct_load_chunk(payload)
