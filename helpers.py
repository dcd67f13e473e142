# SPDX-License-Identifier: Apache-2.0
"""Colocated weight sync: an FSDP2 trainer's weights into a vLLM server (DP + EP) on the same GPUs over
vLLM's CUDA-IPC weight transfer: the server's start (under a watchdog) and routes, the trainer ranks, the
send. Copy it alone for vLLM's own loader; for the direct loader add weight_sync/ and pass
serve_args(..., worker_extension="weight_sync.direct_load.DirectLoadWorker"). It imports nothing of this project:
trainers on more nodes meet through what start_trainers is given (weight_sync/multinode.py's TCPRendezvous).
The server listens on a Unix socket in a directory only its user can enter (its
dev routes and pickled IPC handles let a client run code in it). Each trainer rank is a Ray actor of your
class; its send_weights() calls sender.send():

    trainers, pg = start_trainers(MyTrainer, num_gpus, trainer_args=(...))
    gpu_ids = [p["gpu_ids"][0] for p in placements(trainers)]   # the server on the trainers' GPUs
    with serving([model_path, *serve_args(model_name, gpu_ids)], socket_path=private_dir / "vllm.sock",
                 log_path="vllm-server.log") as server:
        wait_until_healthy(server, timeout_s=1200)
        sock = server.socket_path   # each rank, once: sender = weight_sender(rank, weight_sync_client(sock),
                                    #   ModuleSource(model)), or weight_sync.sources' source and client
        freed = sleep_for_sync(sock, level=0, free_kv_cache=True)   # /sleep (+ /release_kv_cache_memory)
        wake_weights(sock, level=0)                                 # /wake_up?tags=weights (levels 1, 2)
        send_all(trainers, sock, retries=1)                         # every rank's sender.send()
        wake_to_serve(sock, kv_cache=freed)   # after every rank's torch.cuda.empty_cache() if freed
"""

from __future__ import annotations

import atexit
import errno
import json
import math
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
import torch.distributed as dist

# A call that waits on the server (a chunk of weights too) gives up after this, well inside the trainers'
# 10-minute collective timeout: a hung server is reported as such, not as a dead trainer.
SERVER_CALL_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or answered a route with an error."""


# ---- The server process ----
# Run the CLI through Python: it works where no `vllm` console script is installed.
DEFAULT_LAUNCHER = (sys.executable, "-m", "vllm.entrypoints.cli.main")

# The dev routes (/sleep, /collective_rpc, weight transfer) need dev mode, the pickled IPC handles the
# insecure serialization: both safe only because nobody but this user can reach the server (start_server).
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

# A faster start: engine processes forked from the API server, which has imported vLLM; one Triton cache
# (code loaded from vLLM's compile cache looks for its kernels there, else compiles them again).
SERVER_ENV_DEFAULTS = {
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "TRITON_CACHE_DIR": str(Path.home() / ".triton" / "cache"),
}


@dataclass
class Server:
    """A running `vllm serve` and where to reach it."""

    proc: subprocess.Popen
    socket_path: str
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None  # what wait_until_healthy returned
    milestones_shown: set[str] = field(default_factory=set)  # print_progress
    watchdog_fds: tuple[int, int] | None = field(default=None, repr=False)  # `alive`'s write end, `done`'s read end

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True makes the server the leader of its own group


KV_BLOCK_TOKENS = 16  # vLLM's smallest KV cache block (tokens)


def serve_args(
    served_name: str,
    gpu_ids: list[str],
    *,
    num_nodes: int = 1,
    tensor_parallel_size: int = 1,
    experts: bool = True,
    gpu_memory_utilization: float = 0.35,
    kv_cache_memory_bytes: int | None = None,
    kv_cache_tokens: int | None = None,
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    node: int = 0,
    head: tuple[str, int] | None = None,
    worker_extension: str | None = None,
    rollout_dtype: str = "bf16",
) -> list[str]:
    """`vllm serve` flags after the model's path for one node's engines (`gpu_ids`; as many on each of
    `num_nodes`, nodes > 0 headless, reaching node 0 at `head`): a DP engine per TP group, experts over every
    GPU, dummy weights (the trainer sends them), sleep mode, IPC weight transfer, and `worker_extension` if
    given (the direct loader's: "weight_sync.direct_load.DirectLoadWorker"; vLLM's own loader needs none). "fp8":
    vLLM quantizes the routed experts it receives to block-wise FP8. The KV cache: `kv_cache_memory_bytes`, or
    `kv_cache_tokens`, else what `gpu_memory_utilization` leaves (each sync resets every block: 0.25 s per 40 GiB)."""
    if kv_cache_memory_bytes and kv_cache_tokens:
        raise ValueError("pass kv_cache_memory_bytes or kv_cache_tokens, not both")
    dp_size = len(gpu_ids) * num_nodes // tensor_parallel_size
    flags = [
        "--served-model-name",
        served_name,
        "--tensor-parallel-size",
        str(tensor_parallel_size),
        "--data-parallel-size",
        str(dp_size),
        *(["--enable-expert-parallel"] if experts else []),
        "--device-ids",
        ",".join(gpu_ids),
        "--enable-sleep-mode",
        "--load-format",
        "dummy",
        "--weight-transfer-config",
        json.dumps({"backend": "ipc"}),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
    ]
    flags += ["--worker-extension-cls", worker_extension] if worker_extension else []
    if num_nodes > 1:
        local = dp_size // num_nodes
        flags += [
            "--data-parallel-size-local",
            str(local),
            "--data-parallel-address",
            head[0],
            "--data-parallel-rpc-port",
            str(head[1]),
        ]
        if node > 0:
            flags += ["--headless", "--data-parallel-start-rank", str(node * local)]
    if rollout_dtype == "fp8":
        flags += [
            "--quantization",
            "online",
            "--quantization-config",
            json.dumps({"moe": "fp8_per_block"}),
            "--moe-backend",
            "triton",
        ]
    elif rollout_dtype != "bf16":
        raise ValueError(f"rollout_dtype must be 'bf16' or 'fp8', not {rollout_dtype!r}")
    flags += ["--enforce-eager"] if enforce_eager else []
    flags += ["--max-model-len", str(max_model_len)] if max_model_len else []
    flags += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)] if kv_cache_memory_bytes else []
    flags += ["--num-gpu-blocks-override", str(-(-kv_cache_tokens // KV_BLOCK_TOKENS))] if kv_cache_tokens else []
    return flags


def start_server(
    serve_args: Sequence[str],
    *,
    socket_path: str | os.PathLike,
    log_path: str | os.PathLike,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = DEFAULT_LAUNCHER,
    also_stop: Sequence[str] = (),
) -> Server:
    """Start `vllm serve <serve_args>` on `socket_path` (in a 0700 directory, where vLLM's ZMQ sockets
    go too), in its own process group, logging to `log_path`; `env` over SERVER_ENV_DEFAULTS, this process's
    environment and SERVER_ENV, without Ray's GPU mask (`--device-ids` chooses). A watchdog stops the group
    once this process is gone, however it ended, and then `also_stop` ("PID:START")."""
    socket_path = os.fspath(socket_path)
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.stat(folder).st_uid != os.getuid() or stat.S_IMODE(os.stat(folder).st_mode) & 0o077:
        raise ServerError(f"the server's socket must be in a directory private to you (0700): {socket_path}")
    if len(socket_path.encode()) > 100:  # the kernel's limit for a socket path is 107 bytes
        raise ServerError(f"socket path too long for a Unix socket ({len(socket_path)} bytes): {socket_path}")
    if len(folder.encode()) > 70:  # + vLLM's "/<uuid4>" for its ZMQ sockets
        raise ServerError(
            f"the socket's directory is too long for vLLM's own sockets in it (over 70 bytes): "
            f"{os.path.dirname(socket_path)}; set TMPDIR to a shorter directory"
        )
    full_env = {**SERVER_ENV_DEFAULTS, **os.environ, **SERVER_ENV, **(env or {})}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    # vLLM's own ZMQ sockets (/tmp by default, which a user of the same group could reach: they unpickle).
    full_env["VLLM_RPC_BASE_PATH"] = folder
    cmd = [*launcher, "serve", *serve_args, "--uds", socket_path]
    if shutil.which(cmd[0], path=os.pathsep.join(os.get_exec_path(full_env))) is None:
        # What Popen would raise: the watchdog's exec fails only in the child.
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd[0])
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc, watchdog_fds = _start_watched(cmd, log, full_env, also_stop)
    return Server(proc=proc, socket_path=socket_path, log_path=Path(log_path), watchdog_fds=watchdog_fds)


_WATCHDOG_GRACE_S = 10.0  # the watchdog's, between SIGTERM and SIGKILL
WATCHDOG_MARKER = "helpers.server_watchdog"  # its first argument: its processes' command line tells them apart


def _start_watched(
    cmd: list[str], log, env: dict[str, str], also_stop: Sequence[str] = ()
) -> tuple[subprocess.Popen, tuple[int, int]]:
    """Popen(cmd) as the leader of a new process group, through the watchdog program, which forks
    the watchdog off (outside the group) and execs `cmd`: the Popen is the server. Only this process holds
    the write end of `alive`, only the watchdog that of `done`: each reads EOF when the other is gone."""
    alive_r, alive_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _watchdog_program(),
                WATCHDOG_MARKER,
                str(alive_r),
                str(done_w),
                str(_WATCHDOG_GRACE_S),
                *([",".join(also_stop)] if also_stop else []),
                "--",
                *cmd,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            pass_fds=(alive_r, done_w),
        )
    except BaseException:
        os.close(alive_w)
        os.close(done_r)
        raise
    finally:
        os.close(alive_r)
        os.close(done_w)
    return proc, (alive_w, done_r)


def _watchdog_program() -> str:
    """server_watchdog and what it calls, from this file: standard library only, it starts fast and stays small."""
    import inspect

    parts = [inspect.getsource(f) for f in (proc_stat, start_time, group_members, stop_group, server_watchdog)]
    return "\n".join(
        [
            "from __future__ import annotations",
            "import os, select, signal, sys, time",
            "from contextlib import suppress",
            *parts,
            "server_watchdog()",
        ]
    )


def _release_watchdog(server: Server, timeout_s: float = 10.0) -> None:
    """Let the watchdog go (it stops what is left of the group and exits), and wait until it is gone."""
    if server.watchdog_fds is None:
        return
    (alive_w, done_r), server.watchdog_fds = server.watchdog_fds, None
    with suppress(OSError):
        os.write(alive_w, b"r")  # a release, not the caller's death: leave its `also_stop` alone
    os.close(alive_w)
    try:  # readable at EOF alone, once the watchdog exited: only it holds the write end, and never writes
        select.select([done_r], [], [], timeout_s)
    finally:
        os.close(done_r)


# ---- The watchdog: a program of its own (_watchdog_program), standard library only ----
def proc_stat(pid: int | str) -> list[bytes] | None:
    """/proc/PID/stat's fields after the name (state, ppid, pgrp, ...; start time [19]), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """Process `pid`'s start time (clock ticks after boot), None if it is gone or a zombie."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] == b"Z" else stat[19].decode()


def group_members(pgid: int) -> list[int]:
    """PIDs alive in process group `pgid` (Linux /proc), zombies excluded."""
    return [
        int(entry)
        for entry in filter(str.isdigit, os.listdir("/proc"))
        if (stat := proc_stat(entry)) is not None and stat[0] != b"Z" and int(stat[2]) == pgid
    ]


def stop_group(pgid: int, grace_s: float) -> list[int]:
    """SIGTERM process group `pgid`, SIGKILL what is left after `grace_s`;
    returns what is still there 10 s after SIGKILL (else [])."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return []
        deadline = time.monotonic() + wait_s
        while (left := group_members(pgid)) and time.monotonic() <= deadline:
            time.sleep(0.2)
        if not left:
            return []
    return left


def server_watchdog() -> None:
    """python -c <_watchdog_program()> helpers.server_watchdog ALIVE_FD DONE_FD GRACE_S [ALSO] -- CMD [ARGS...]
    The group's leader forks off a watchdog into a session of its own, then execs CMD, keeping its PID. On
    EOF on ALIVE_FD (the caller is gone, however it ended, or stop_server let go) the watchdog stops the
    group (SIGTERM, SIGKILL after GRACE_S) and exits, closing DONE_FD; as it does when the group empties.
    ALSO ("PID:START,..."): the caller's other processes (a local Ray's agents outlive a SIGKILLed driver
    by minutes), SIGKILLed only if the caller is gone (stop_server writes "r" first); START: not a reused PID."""

    def say(text: str) -> None:
        with suppress(OSError):
            os.write(2, f"[server_watchdog] {text}\n".encode())

    def watch(pgid: int, alive_fd: int, leader_fd: int | None, grace_s: float, also: list[str]) -> None:
        watching_leader, released = leader_fd is not None, False
        while True:
            # Block on the leader's pidfd while it runs; then (its engines may live on) look once a second.
            ready, _, _ = select.select(
                [alive_fd] + ([leader_fd] if watching_leader else []), [], [], None if watching_leader or also else 1.0
            )
            if alive_fd in ready:
                data = b""
                with suppress(OSError):
                    data = os.read(alive_fd, 4096)
                released = released or b"r" in data  # stop_server says so before it lets go
                if not data:  # EOF: the caller is gone, or stop_server let go
                    if group_members(pgid):
                        say(f"the process that started the vLLM server is gone: stopping its process group {pgid}")
                        if left := stop_group(pgid, grace_s):
                            say(f"processes {left} of group {pgid} survived SIGKILL")
                    if also and not released:  # the caller is gone: what else it started goes too
                        say(f"stopping {len(also)} other processes the caller started")
                        for pid, start in (entry.split(":") for entry in also):
                            if start_time(int(pid)) == start:  # still that same process
                                with suppress(ProcessLookupError):
                                    os.kill(int(pid), signal.SIGKILL)
                    return
            watching_leader = watching_leader and leader_fd not in ready
            # An empty group ends the watch, unless ALSO is in our care (then only the caller's release or death).
            if not watching_leader and not also and not group_members(pgid):
                return

    alive_fd, done_fd, grace_s, *rest = sys.argv[2:]
    also = rest.pop(0).split(",") if rest and rest[0] != "--" else []
    if len(rest) < 2 or rest[0] != "--":
        sys.exit("usage: server_watchdog ALIVE_FD DONE_FD GRACE_S [PID:START,...] -- CMD [ARGS...]")
    alive_fd, done_fd, cmd, leader = int(alive_fd), int(done_fd), rest[1:], os.getpid()
    try:
        leader_fd = os.pidfd_open(leader)  # readable once the server exits (Linux 5.3+)
    except (AttributeError, OSError):
        leader_fd = None
    child = os.fork()
    if child == 0:
        # Twice forked, in a session of its own: out of the server's group and its signals, and not the
        # server's child (which would not reap it).
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_IGN)
            os.dup2(fd := os.open(os.devnull, os.O_RDONLY), 0)
            os.close(fd)
            watch(leader, alive_fd, leader_fd, float(grace_s), also)
        except BaseException as e:  # noqa: BLE001 - say it in the server's log, whatever it was
            say(f"failed: {e!r}")
            os._exit(1)
        os._exit(0)  # closes done_fd: the caller sees the watchdog gone
    # The server: once the watchdog is out of the group, let go of the pipes and become the server.
    os.waitpid(child, 0)
    for fd in (alive_fd, done_fd, leader_fd):
        if fd is not None:
            os.close(fd)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        say(f"cannot run {cmd[0]}: {e}")
        os._exit(127)


def log_tail(server: Server, lines: int = 40) -> str:
    try:
        return "\n".join(server.log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# A starting `vllm serve`'s milestones by their first log line (0.32), for progress lines only.
START_MILESTONES = (
    ("Initializing a V1 LLM engine", "engines starting"),
    ("Model loading took", "model built (dummy weights)"),
    ("Starting torch.compile", "torch.compile ..."),
    ("torch.compile took", "torch.compile done"),
    ("Capturing CUDA", "capturing CUDA graphs ..."),
    ("Available KV cache memory", "memory profiled, KV cache sized"),
    ("init engine (profile, create kv cache, warmup model) took", "engines ready"),
    ("Starting vLLM server on", "API server listening"),
)


def print_progress(server: Server) -> None:
    """Print each START_MILESTONES line the log has reached since the last call."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return
    for needle, label in START_MILESTONES:
        if label not in server.milestones_shown and needle in text:
            server.milestones_shown.add(label)
            print(f"[server] {time.monotonic() - server.started_at:5.0f} s: {label}", flush=True)


def wait_until_healthy(server: Server, timeout_s: float = 900, poll_s: float = 1.0, also_check=None) -> float:
    """Until GET /health answers 200, printing progress; seconds since start. ServerError with the
    log's end if the server exits or at the deadline; `also_check()` runs every poll, and may raise."""
    deadline = time.monotonic() + timeout_s
    while True:
        print_progress(server)
        if (code := server.proc.poll()) is not None:
            raise ServerError(
                f"vLLM server exited with code {code} during start; last lines of "
                f"{server.log_path}:\n{log_tail(server)}"
            )
        if also_check:  # after our own server's exit: that one we name for sure
            also_check()
        if health(server.socket_path):
            print_progress(server)  # the lines the log reached since this poll's first look
            return time.monotonic() - server.started_at
        if time.monotonic() > deadline:
            raise ServerError(
                f"vLLM server not healthy after {timeout_s:.0f}s; last lines of {server.log_path}:\n{log_tail(server)}"
            )
        time.sleep(poll_s)


def stop_server(server: Server, grace_s: float = 20.0) -> None:
    """SIGTERM the server's group, SIGKILL what is left after `grace_s`, wait for every process and the watchdog."""
    if left := stop_group(server.pgid, grace_s):
        raise ServerError(f"processes {left} of the vLLM server survived SIGKILL")
    with suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=10)  # the leader's exit status, and no zombie left
    _release_watchdog(server)
    _forget_client(server.socket_path)


@contextmanager
def serving(serve_args: Sequence[str], **start_kwargs):
    """start_server(...), yielding the server still starting (wait_until_healthy
    later); on the way out stop it, quoting its log if it had exited on its own."""
    server = start_server(serve_args, **start_kwargs)
    try:
        yield server
    finally:
        with signals_ignored():
            if server.proc.poll() is not None:
                print(
                    f"[shutdown] the vLLM server had exited with code {server.proc.returncode}; "
                    f"last lines of {server.log_path}:\n{log_tail(server, 15)}",
                    flush=True,
                )
            print("[shutdown] stopping the vLLM server", flush=True)
            try:
                stop_server(server)
            except ServerError as e:  # say it, and keep the error that brought us here
                print(f"[shutdown] {e}", flush=True)


@contextmanager
def signals_ignored():
    """Let a cleanup finish: a second Ctrl-C, SIGTERM or SIGHUP would cut it short and leave processes behind."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = [signal.signal(sig, signal.SIG_IGN) for sig in sigs]
    try:
        yield
    finally:
        for sig, handler in zip(sigs, previous, strict=True):
            signal.signal(sig, handler)


# ---- HTTP routes: one small function each. `sock` is the server's socket path ----
# One client per socket and process, its connection kept open: a round's calls are milliseconds apart.
_clients: dict[tuple[int, str], httpx.Client] = {}


def _client(sock: str) -> httpx.Client:
    key = (os.getpid(), sock)  # (a forked child opens its own connection)
    if key not in _clients:
        # No TLS context (~30 ms to build), no proxy; an idle connection dropped at half the server's
        # keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), never reused just as the server closes it.
        idle_s = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")) / 2
        transport = httpx.HTTPTransport(uds=sock, verify=False, limits=httpx.Limits(keepalive_expiry=idle_s))
        _clients[key] = httpx.Client(transport=transport, base_url="http://localhost", trust_env=False)
    return _clients[key]


def _forget_client(sock: str, close: bool = True) -> None:
    """Drop this process's client for `sock`: closed, or (close=False) left to a call another thread may be making."""
    client = _clients.pop((os.getpid(), sock), None)
    if client is not None and close:
        client.close()


def request(sock: str, method: str, route: str, timeout: float = SERVER_CALL_TIMEOUT_S, **kwargs) -> Any:
    """Call any route (httpx's keyword arguments); return its JSON; raise ServerError with the server's text."""
    try:
        resp = _client(sock).request(method, route, timeout=timeout, **kwargs)
    except httpx.HTTPError as e:
        _forget_client(sock, close=False)
        raise ServerError(f"{method} {route} failed: {e!r}") from e
    if resp.status_code != 200:
        # vLLM may reset the connection after an error reply (seen after a 500): the next call opens anew.
        _forget_client(sock, close=False)
        raise ServerError(f"{method} {route} -> HTTP {resp.status_code}: {resp.text[:2000]}")
    return resp.json() if resp.content else None


def health(sock: str) -> bool:
    try:
        request(sock, "GET", "/health", timeout=5)  # (through request: its rules for a failed call's connection)
    except ServerError:
        return False
    return True


def sleep(sock: str, level: int) -> dict:
    """POST /sleep: level 0 pauses scheduling; 1 also offloads the weights to CPU, 2 discards them."""
    return request(sock, "POST", "/sleep", params={"level": level})


def release_kv_cache(sock: str) -> dict:
    """POST /release_kv_cache_memory (after /sleep?level=0): the KV cache freed, the prefix cache reset."""
    return request(sock, "POST", "/release_kv_cache_memory")


def sleep_for_sync(sock: str, level: int, free_kv_cache: bool = True) -> bool:
    """Stop serving until the sync: level 0 keeps the weights mapped (written in place) and frees the
    KV cache (`free_kv_cache`) or resets the prefix cache; 1 and 2 free both. Returns whether the KV cache is freed."""
    sleep(sock, level)
    if level == 0:
        release_kv_cache(sock) if free_kv_cache else reset_prefix_cache(sock)
    return level > 0 or free_kv_cache


def reset_prefix_cache(sock: str) -> None:
    request(sock, "POST", "/reset_prefix_cache")


def wake_weights(sock: str, level: int) -> None:
    """POST /wake_up?tags=weights before the send, unless level 0 kept them mapped."""
    if level > 0:
        wake_up(sock, ["weights"])


def wake_up(sock: str, tags: Iterable[str] | None = None) -> dict:
    """POST /wake_up?tags=...: map back the named memory pools (all if None)."""
    return request(sock, "POST", "/wake_up", params=[("tags", t) for t in tags] if tags else None)


def wake_to_serve(sock: str, kv_cache: bool = True) -> None:
    """POST /wake_up?tags=kv_cache (if freed)&tags=scheduling; raise unless then awake."""
    try:
        state = wake_up(sock, ["kv_cache", "scheduling"] if kv_cache else ["scheduling"])
    except ServerError as e:
        raise ServerError(wake_failure(str(e), kv_cache)) from e
    if state["status"] != "awake":
        raise ServerError(f"server still asleep after the last wake_up: {state}")


def wake_failure(error: str, kv_cache: bool) -> str:
    """Out of memory while mapping a freed KV cache back is memory taken meanwhile: say so."""
    if kv_cache and "out of memory" in error.lower():
        return (
            "vLLM could not map its KV cache back: the GPU's memory it freed was taken meanwhile (by another "
            "process on the GPU, or kept by the trainer); keep the KV cache through the sync, or make it "
            f"smaller: {error}"
        )
    return error


def is_sleeping(sock: str) -> bool:
    return request(sock, "GET", "/is_sleeping")["is_sleeping"]


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]


_openai_clients: dict[int, tuple] = {}


def openai_client(sock: str):
    """The openai client over the socket (`requests` cannot reach a Unix socket)."""
    import openai

    transport = _client(sock)
    made = _openai_clients.get(id(transport))
    if made is None or made[0] is not transport:  # (a dropped connection's client goes with it)
        made = _openai_clients[id(transport)] = (
            transport,
            openai.OpenAI(base_url="http://localhost/v1", api_key="-", max_retries=0, http_client=transport),
        )
    return made[1]


def post_completions(sock: str, dp_rank: int | None = None, **fields):
    """POST /v1/completions through the openai client (vLLM's own fields in
    `extra_body`); `dp_rank` pins one DP engine. Raises ServerError."""
    import openai

    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    try:
        return openai_client(sock).completions.create(extra_headers=headers, timeout=SERVER_CALL_TIMEOUT_S, **fields)
    except openai.APIStatusError as e:
        _forget_client(sock, close=False)  # (as `request` does after an error reply)
        raise ServerError(f"POST /v1/completions -> HTTP {e.status_code}: {e.response.text[:2000]}") from e
    except openai.APIError as e:
        _forget_client(sock, close=False)
        raise ServerError(f"POST /v1/completions failed: {e!r}") from e


def completions(
    sock: str, model: str, prompts: list[str], max_tokens: int, temperature: float = 0.0, dp_rank: int | None = None
) -> list[Completion]:
    """One completion per prompt (greedy by default), with the prompt's and the output's token ids."""
    out = post_completions(
        sock,
        dp_rank,
        model=model,
        prompt=prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        extra_body={"return_token_ids": True},
    )
    by_index = {c.index: c for c in out.choices}
    return [
        Completion(c.text, list(c.prompt_token_ids), list(c.token_ids))
        for c in (by_index[i] for i in range(len(prompts)))
    ]


def collective_rpc(sock: str, method: str, *args: str, timeout: float = SERVER_CALL_TIMEOUT_S) -> list:
    """POST /collective_rpc: `method` (string arguments) on every engine's worker; the first DP engine's results."""
    body = {"method": method, "args": list(args), "timeout": timeout}
    out = request(sock, "POST", "/collective_rpc", timeout=timeout + 10, json=body)
    return out["results"] if out else []


# ---- Weight sync clients: what vLLM's IPC trainer engine calls on trainer rank 0 ----
def weight_sync_client(sock: str):
    """vLLM's HTTPVLLMWeightSyncClient (its weight routes) over the socket, raising ServerError."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class WeightSyncClient(HTTPVLLMWeightSyncClient):
        def _post(self, path: str, json: dict | None = None) -> None:
            request(sock, "POST", f"/{path}", timeout=self.timeout, json=json)

    return WeightSyncClient(sock, timeout=SERVER_CALL_TIMEOUT_S)


class FailAfterSend:
    """Rank 0's weight sync client, safe to retry: every rank meets at a barrier per chunk, so rank 0
    must not raise in the send. After a failed call the updates are skipped, finish still runs (the direct
    loader's closes its session), and raise_failure() raises once every rank is through."""

    def __init__(self, client) -> None:
        self.client, self._failure = client, None  # (the client it wraps)

    def start_weight_update(self) -> None:
        self._failure = None
        self._call(self.client.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        if self._failure is None:
            self._call(self.client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.client.finish_weight_update, weight_version)

    def raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def __getattr__(self, name: str):  # anything else vLLM calls, e.g. init_weight_transfer_engine: at setup, raising
        return getattr(self.client, name)

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except ServerError as e:
            self._failure = self._failure or e


# ---- The trainer ranks: one Ray actor per GPU, in one process group ----
# Calls go to every rank at once (collectives) and must not wait on a dead one (ray_get_all). A rank is of
# any class: these functions run in it through Ray's __ray_call__; send_all calls its send_weights().
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # longer than any server call (SERVER_CALL_TIMEOUT_S)


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on the nodes asked for."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


_store = None  # rank 0's: the store the ranks meet at


def open_rendezvous(host: str, world_size: int, rendezvous=None) -> str | int:
    """Rank 0: open the store the ranks meet at; returns where. One node: a FileStore in a 0700 directory
    (no port for other local users), its path, to keep while the ranks run. More: `rendezvous.open`'s
    store on `host` (weight_sync/multinode.py's TCPRendezvous: a TCPStore), its port."""
    global _store
    if rendezvous is not None:
        _store, port = rendezvous.open(host, world_size, COLLECTIVE_TIMEOUT)
        return port
    folder = Path(tempfile.mkdtemp(prefix="rlhf-ipc-rendezvous-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # if this rank ends normally
    path = folder / "store"
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # ours, before torch opens it
    _store = file_store(path, world_size)
    return str(path)


def join_process_group(rank: int, world_size: int, host: str, where: str | int, rendezvous=None) -> None:
    """Join the group at what open_rendezvous returned (with the same `rendezvous`). CUDA tensors over
    NCCL, the rest over gloo: vLLM's IPC engine's per-chunk all_gather_object + barrier wait on the host,
    not on the engine's GPU."""
    if rendezvous is not None:
        store = rendezvous.join(rank, host, where, world_size, _store, COLLECTIVE_TIMEOUT)
    else:
        store = _store if rank == 0 else file_store(where, world_size)
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )


def placement() -> dict:
    """Which GPU, on which node, Ray gave this rank (run in it)."""
    info = {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
        "node": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_name=props.name, gpu_uuid=str(props.uuid))
    return info


def placements(trainers: list) -> list[dict]:
    return ray_get_all([t.__ray_call__.remote(_in_rank, placement) for t in trainers])


def _in_rank(_trainer, fn, *args):
    return fn(*args)  # what __ray_call__ runs in a rank: `fn(*args)`, without the trainer object


def file_store(path: str | os.PathLike, world_size: int) -> dist.FileStore:
    """Torch's FileStore with the collectives' timeout (it reopens the file: its directory must outlive the ranks)."""
    store = dist.FileStore(str(path), world_size)
    store.set_timeout(COLLECTIVE_TIMEOUT)
    return store


_rendezvous_dirs: dict[str, Path] = {}  # placement group id -> its trainers' one-node store's directory


def remove_rendezvous(pg) -> None:
    """Remove the one-node store's directory of `pg`'s trainers (gone, or going)."""
    if (where := _rendezvous_dirs.pop(pg.id.hex(), None)) is not None:
        shutil.rmtree(where, ignore_errors=True)


@atexit.register
def _remove_rendezvous_left() -> None:
    """At exit, the stores remove_rendezvous was not called for (Ray stops a job's trainers with its driver)."""
    for where in _rendezvous_dirs.values():
        shutil.rmtree(where, ignore_errors=True)


def start_trainers(
    trainer_cls: type,
    num_trainers: int,
    num_nodes: int = 1,
    gpus_per_trainer: float = 1,
    placement_timeout_s: float = 60,
    trainer_args: tuple = (),
    rendezvous=None,
) -> tuple[list, object]:
    """One GPU per trainer rank, as many on each of `num_nodes` nodes, the first this one; the ranks
    (actors of `trainer_cls`, any class, built with `trainer_args`) joined in one process group in node
    order. On more than one node they meet through `rendezvous` (weight_sync.multinode.TCPRendezvous);
    on one node through a file, and `rendezvous` is not used. Returns (trainers, placement group);
    PlacementError if Ray cannot place them in time."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_nodes > 1 and rendezvous is None:
        raise ValueError(
            f"trainer ranks on {num_nodes} nodes meet over TCP, which helpers.py does not do alone: copy "
            "weight_sync/multinode.py beside it and pass start_trainers(..., rendezvous=multinode.TCPRendezvous)"
        )
    rendezvous = rendezvous if num_nodes > 1 else None
    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_trainer and have < num_trainers * gpus_per_trainer:
        raise PlacementError(f"asked for {num_trainers} GPUs but the Ray cluster has {have:g}")
    per_node = num_trainers // num_nodes
    here = ray.get_runtime_context().get_node_id()
    here_gpus = next(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == here)
    if here_gpus < per_node * gpus_per_trainer:
        raise PlacementError(
            f"this node has {here_gpus:g} GPUs in Ray, and needs {per_node * gpus_per_trainer:g}: "
            "run the script on a GPU node (it runs vLLM's API server and trainer rank 0)"
        )
    # A bundle per node (CUDA IPC stays on one machine: each rank beside its GPU's engine), the first this one.
    bundle = {"CPU": per_node, **({"GPU": per_node * gpus_per_trainer} if gpus_per_trainer else {})}
    pg = placement_group(
        [bundle] * num_nodes,
        strategy="STRICT_SPREAD" if num_nodes > 1 else "STRICT_PACK",
        bundle_label_selector=[{"ray.io/node-id": here}] + [{}] * (num_nodes - 1),
    )
    if not pg.wait(timeout_seconds=placement_timeout_s):
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place {num_trainers} trainers on {num_nodes} node(s) ({bundle} on each, "
            f"the first one this node) within {placement_timeout_s:.0f}s; cluster resources: "
            f"{ray.cluster_resources()}"
        )
    actor = trainer_cls if isinstance(trainer_cls, ray.actor.ActorClass) else ray.remote(trainer_cls)
    try:
        trainers = [
            actor.options(
                num_cpus=1,
                num_gpus=gpus_per_trainer,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r // per_node),
            ).remote(*trainer_args)
            for r in range(num_trainers)
        ]
        # One node: rendezvous on loopback. More: on rank 0's address, which the other nodes reach.
        host = "127.0.0.1" if num_nodes == 1 else ray.util.get_node_ip_address()
        opened = trainers[0].__ray_call__.remote(_in_rank, open_rendezvous, host, num_trainers, rendezvous)
        where = ray_get_all([opened])[0]
        if isinstance(where, str):  # one node, this one: the store's file, in a directory of its own
            _rendezvous_dirs[pg.id.hex()] = Path(where).parent
        ray_get_all(
            [
                t.__ray_call__.remote(_in_rank, join_process_group, r, num_trainers, host, where, rendezvous)
                for r, t in enumerate(trainers)
            ]
        )
    except BaseException:  # a rank that did not start, or Ctrl-C: the caller never gets the group to remove
        ray.util.remove_placement_group(pg)  # and its trainers with it
        remove_rendezvous(pg)
        raise
    return trainers, pg


def leave_ray(started_ray: bool, pg) -> None:
    """Ray as we found it: shut down if we started it, else our group removed; and the rendezvous directory."""
    if started_ray:
        ray.shutdown()
    elif pg is not None:
        ray.util.remove_placement_group(pg)
    if pg is not None:
        remove_rendezvous(pg)


def ray_get_all(refs: list, who: str = "a trainer rank", also_check=None):
    """ray.get(refs), raising once one fails (the others may wait for it in a collective): ServerError
    prefixed by `who`, a dead actor as TrainerDied. `also_check()` runs every 2 s meanwhile, and may raise."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=None if also_check is None else 2)
        if not done:
            also_check()
            continue
        try:
            ray.get(done[0])
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, ServerError):
                raise ServerError(f"{who}: {e.cause}") from None
            raise
        except ray.exceptions.RayActorError as e:
            raise TrainerDied(f"{who}'s process died: {death_cause(e)}") from e
    return ray.get(refs)


def death_cause(error: Exception) -> str:
    """The first line of Ray's report, and the error that killed the actor if it names one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return lines[0] + (f" ... {cause[-1]}" if cause and cause[-1] != lines[0] else "")


def send_all(trainers: list, sock: str, retries: int = 0, check_failure=None) -> tuple[list, int]:
    """send_weights() on every rank; their reports and the retries. A send the server failed part way is
    sent again, whole, up to `retries` times (vLLM is still asleep); not after a dead rank or a silent server.
    `check_failure(error)` runs at each failure and may raise a cause found elsewhere (another node's server)."""
    first = why = None
    for attempt in range(retries + 1):
        sends = [t.send_weights.remote() for t in trainers]
        try:
            return ray_get_all(sends, also_check=_answering(sock)), attempt
        except ServerError as e:
            first = first or e
            if check_failure:
                check_failure(
                    ServerError(f"the send failed part way (not retried); vLLM holds a mix of old and new weights: {e}")
                )
            if attempt == retries:
                why = None if retries else "not retried"  # --send-retries 0, or vLLM's own loader (send_retries)
                break
            if not health(sock):
                why = "not retried: the server does not answer"
                break
            if len(ray.wait(sends, num_returns=len(sends), timeout=60)[0]) < len(sends):
                why = "not retried: a trainer rank is still in the send"
                break
            print(
                f"[send] {e}\n[send] vLLM is still asleep: sending every weight again "
                f"(retry {attempt + 1} of {retries})",
                flush=True,
            )
    detail = why or (f"{attempt + 1} tries" if attempt else "")
    raise ServerError(
        f"the send failed part way{f' ({detail})' if detail else ''}; vLLM holds a mix of old and new weights: {first}"
    )


def _answering(sock: str):
    """For ray_get_all: raise once /health failed twice in a row (a dead engine's API
    server stays up, and the chunk in flight never returns)."""
    misses = [0]

    def check() -> None:
        misses[0] = 0 if health(sock) else misses[0] + 1
        if misses[0] >= 2:
            raise ServerError("the vLLM server stopped answering GET /health during the send (its engine died?)")

    return check


def wait_until_ready(server: Server, filling: list, timeout_s: float, also_check=None) -> float:
    """Wait for the trainers' weights (`filling`), then for health (wait_until_healthy);
    returns when the weights were in, in seconds into the server's start."""
    while filling and server.proc.poll() is None:
        done, filling = ray.wait(filling, num_returns=len(filling), timeout=2)
        ray_get_all(done)
        if also_check:
            also_check()
        print_progress(server)
    filled_after_s = time.monotonic() - server.started_at
    if not filling:  # else the server exited first, and wait_until_healthy says how
        print(f"[trainers] weights in, {filled_after_s:.0f} s into the server's start", flush=True)
    server.healthy_after_s = wait_until_healthy(server, timeout_s - filled_after_s, also_check=also_check)
    print(f"[server] healthy after {server.healthy_after_s:.1f} s at {server.socket_path}", flush=True)
    return filled_after_s


# ---- A trainer rank's half of the sync ----
def metadata_bytes(metadata) -> int:
    """What tensors of this metadata (ParamMeta) take, in bytes."""
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metadata)


@dataclass
class WeightSender:
    """One trainer rank's side of the sync (weight_sender builds it; another can be built around the same source)."""

    client: FailAfterSend
    engine: Any  # vLLM's IPC trainer engine
    experts_in_place: Any  # the direct loader's blocks the engines copy from this rank (sources.ExpertsInPlace)
    source: Any  # all it sends (a WeightSource): the packed part, then the blocks in place
    rank: int
    packed: bool
    packed_buffer_size_bytes: int

    def send(self) -> None:
        """One full sync on every rank at once; rank 0's server error raised after it."""
        if self.experts_in_place is not None:
            self.experts_in_place.gather()  # rank 0's client hands every rank's handles to the engines
        self.engine.send_weights()
        self.client.raise_failure()


def weight_sender(
    rank: int, client, source, packed: bool = True, packed_buffer_size_bytes: int = 4 * 1024**3
) -> WeightSender:
    """vLLM's IPC trainer engine on this rank: `source`'s tensors (a vLLM WeightSource: ModuleSource,
    or weight_sync.sources') packed into one IPC buffer each engine reads on its GPU; rank 0 calls `client`
    per chunk (weight_sync_client, or sources.sync_client: the direct loader, whose expert blocks skip it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    in_place = getattr(source, "experts_in_place", None)
    if in_place is not None and getattr(client, "experts_in_place", None) is not in_place:
        in_place = None  # a client that does not hand them to the engines (vLLM's routes): they go packed
    packed_part = in_place.packed_part(source) if in_place else source  # all but the blocks in place
    told = getattr(client, "packed_bytes", None)
    if told is not None and told != (packs := metadata_bytes(packed_part.metadata)):
        raise ValueError(
            f"the direct loader's client expects {told} packed bytes a send and this source packs "
            f"{packs}: build the client for this source (sync_client)"
        )
    client = FailAfterSend(client)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=rank, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes),
        client=client,
        source=packed_part,
    )
    return WeightSender(client, engine, in_place, source, rank, packed, packed_buffer_size_bytes)
