# SPDX-License-Identifier: Apache-2.0
"""--check-coverage: zero every vLLM parameter, sync once, and list what the sync left zero."""

from __future__ import annotations

import functools

import helpers
from weight_sync import multinode, ray_trainers


def weight_checker(sock: str, action: str, baseline: dict | None = None) -> dict:
    """POST /weight_checker: 'reset' zeroes every parameter, 'checksum' returns {key: sha256}.

    'compare' checks the parameters against `baseline`.
    """
    body = {"action": action, **({"baseline": baseline} if baseline is not None else {})}
    return helpers.request(sock, "POST", "/weight_checker", body=body)


def zero_vllm_weights(sock: str, sleep_level: int) -> dict[str, str]:
    """Run the first half of a sync, then zero every vLLM parameter on every DP rank; return their checksums.

    The first half is sleeping and waking the weights. Whatever the following sync fails to write stays zero.
    """
    helpers.sleep_for_sync(sock, sleep_level)
    helpers.wake_weights(sock, sleep_level)
    weight_checker(sock, "reset")
    return weight_checker(sock, "checksum")["checksums"]


def check_coverage(job, sleep_level: int) -> dict:
    """Sync into zeroed vLLM weights and report what the sync left zero."""
    zeros = zero_vllm_weights(job.server.socket_path, sleep_level)
    ray_trainers.send_all(job.trainers, check_failure=functools.partial(multinode.raise_node_failure, job.node_servers))
    helpers.wake_to_serve(job.server.socket_path)
    result = coverage(job.server.socket_path, zeros)
    print(f"[coverage] {result['parameters']} vLLM parameters, unwritten: {result['unwritten']}", flush=True)
    return result


def coverage(sock: str, zeros: dict[str, str]) -> dict:
    """Return which parameters a sync after zero_vllm_weights left zero.

    vLLM's /weight_checker is slow, because it hashes every tensor.
    """
    written = set(weight_checker(sock, "compare", baseline=zeros)["mismatches"])
    return {"parameters": len(zeros), "unwritten": sorted(set(zeros) - written)}
