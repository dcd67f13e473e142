# SPDX-License-Identifier: Apache-2.0
"""Each GPU's memory after a sync: the trainer rank's (PyTorch's counters) and the vLLM server's
processes' there (NVML, told apart by the server's process group)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import ray
import torch

import helpers

GiB = 1024**3


@dataclass
class GPUMemory:
    """One GPU after a sync, GiB."""

    trainer_peak_allocated: float  # the trainer's peak since the previous reading (this round)
    trainer_reserved: float
    server_used: float  # the vLLM server's processes on this GPU (NVML; every other process if its group is unknown); NaN if unknown
    device_used: float  # all processes, this job's and any other's
    job_used: float = math.nan  # this trainer rank's process and the server's on this GPU (NVML); NaN if unknown


def server_pgids_per_rank(server, node_servers: list, num_gpus: int, num_nodes: int) -> list[int]:
    """For each rank, the process group of the vLLM server on its node (ranks
    go in node order), as `memory` takes them."""
    per_node = [server.pgid, *helpers.ray_get_all([s.pgid.remote() for s in node_servers], who="a node's server actor")]
    return [per_node[r // (num_gpus // num_nodes)] for r in range(num_gpus)]


def memory(trainers: list, server_pgids: list | None = None) -> list[GPUMemory]:
    """Each rank's GPU (`server_pgids`: per rank, its node's server's process group)."""
    return ray.get(
        [t.__ray_call__.remote(memory_gib, server_pgids[r] if server_pgids else None) for r, t in enumerate(trainers)]
    )


def memory_gib(trainer, server_pgid: int | None = None) -> GPUMemory:
    """In a rank: its GPU now, and the trainer's peak since the last reading;
    `server_pgid`: the process group of the vLLM server on this node."""
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


def nvml_gpu_memory(gpu_uuid: str, server_pgid: int | None = None) -> tuple[float, float]:
    """(bytes this process uses on the GPU with this UUID, bytes the server's
    processes use there: those of process group `server_pgid`, or every other
    process if None), from NVML; NaN where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            procs = [(p.pid, p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML, no permission
        return math.nan, math.nan
    return split_gpu_memory(procs, os.getpid(), server_pgid)


def split_gpu_memory(procs: list[tuple[int, int]], me: int, server_pgid: int | None, getpgid=os.getpgid):
    """nvml_gpu_memory's (mine, the server's) from NVML's (pid, bytes) list."""
    if me not in {pid for pid, _ in procs}:
        return math.nan, math.nan  # NVML sees another PID namespace: it cannot tell us apart

    def servers(pid: int) -> bool:
        if server_pgid is None:
            return True
        try:
            return getpgid(pid) == server_pgid
        except OSError:  # gone, or on another node
            return False

    mine = float(sum(used for pid, used in procs if pid == me))
    return mine, float(sum(used for pid, used in procs if pid != me and servers(pid)))
