# SPDX-License-Identifier: Apache-2.0
"""Measure each GPU's memory after a sync, for the trainer rank and for the vLLM server's processes, and what a
training step could use once vLLM sleeps.

The trainer's comes from PyTorch's counters. The server's comes from NVML, told apart from other processes by
the server's process group.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import ray
import torch

from weight_sync import ray_trainers

GiB = 1024**3


@dataclass
class GPUMemory:
    """Hold one GPU's memory after a sync, in GiB."""

    trainer_peak_allocated: float  # The trainer's peak since the previous reading, which covers this round.
    trainer_reserved: float
    # The vLLM server's processes on this GPU, from NVML. Every other process counts if the server's
    # process group is unknown; NaN if NVML cannot tell.
    server_used: float
    device_used: float  # All processes, this job's and any other's.
    job_used: float = math.nan  # This trainer rank's process and the server's on this GPU; NaN if unknown.


def server_pgids_per_rank(server, node_servers: list, num_gpus: int, num_nodes: int) -> list[int]:
    """Return, for each rank, the process group of the vLLM server on its node, as `memory` takes them.

    Ranks go in node order.
    """
    per_node = [
        server.pgid,
        *ray_trainers.ray_get_all([s.pgid.remote() for s in node_servers], who="a node's server actor"),
    ]
    return [per_node[r // (num_gpus // num_nodes)] for r in range(num_gpus)]


def memory(trainers: list, server_pgids: list | None = None) -> list[GPUMemory]:
    """Measure each rank's GPU; `server_pgids` gives, per rank, its node's server's process group."""
    return ray.get(
        [t.__ray_call__.remote(memory_gib, server_pgids[r] if server_pgids else None) for r, t in enumerate(trainers)]
    )


def memory_gib(trainer, server_pgid: int | None = None) -> GPUMemory:
    """Measure, in a rank, its GPU now and the trainer's peak since the last reading.

    `server_pgid` is the process group of the vLLM server on this node.
    """
    device = trainer.device
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    mine, server = nvml_gpu_memory(str(torch.cuda.get_device_properties(device).uuid), server_pgid)
    return GPUMemory(
        trainer_peak_allocated=peak / GiB,
        trainer_reserved=torch.cuda.memory_reserved(device) / GiB,
        server_used=server / GiB,
        device_used=(total - free) / GiB,
        job_used=(mine + server) / GiB if server_pgid is not None else math.nan,
    )


def free_for_step(trainers: list) -> list[dict]:
    """Measure, on each rank's GPU, the memory a training step started now could use (see free_for_step_gib)."""
    return ray.get([t.__ray_call__.remote(free_for_step_gib) for t in trainers])


def free_for_step_gib(trainer) -> dict:
    """Return, in GiB, what a step in this rank could allocate now: the GPU's free memory (`device_free`) and what
    the rank's own PyTorch holds but has not handed out (`trainer_cached`), and their sum (`total`)."""
    device = trainer.device
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return {"device_free": free / GiB, "trainer_cached": cached / GiB, "total": (free + cached) / GiB}


def nvml_gpu_memory(gpu_uuid: str, server_pgid: int | None = None) -> tuple[float, float]:
    """Return, from NVML, the bytes this process and the server's processes use on the GPU with this UUID.

    The server's processes are those in process group `server_pgid`, or every other process if it is None.
    Each value is NaN if NVML cannot tell.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = [(p.pid, p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # No NVML, or no permission.
        return math.nan, math.nan
    return split_gpu_memory(procs, os.getpid(), server_pgid)


def split_gpu_memory(procs: list[tuple[int, int]], me: int, server_pgid: int | None, getpgid=os.getpgid):
    """Split NVML's (pid, bytes) list into nvml_gpu_memory's (mine, the server's)."""
    if me not in {pid for pid, _ in procs}:
        return math.nan, math.nan  # NVML sees another PID namespace, so it cannot tell processes apart.

    def servers(pid: int) -> bool:
        if server_pgid is None:
            return True
        try:
            return getpgid(pid) == server_pgid
        except OSError:  # The process is gone, or on another node.
            return False

    mine = float(sum(used for pid, used in procs if pid == me))
    return mine, float(sum(used for pid, used in procs if pid != me and servers(pid)))
