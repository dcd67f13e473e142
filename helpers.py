"""Colocated weight sync: an FSDP2 trainer's weights into a vLLM server
(data parallel + expert parallel) on the same GPUs, over vLLM's CUDA-IPC
weight-transfer engine: the server's launch and its HTTP endpoints, the
trainer ranks, the send. The module to copy into your RL code, with
weight_sync/direct_load.py beside it for the direct loader (the server's
worker extension, which the server imports from its PYTHONPATH; also where
vLLM 0.32, 0.33 and 0.34 differ).

The server listens on a Unix socket in a directory only its user can enter,
never on a TCP port: its dev routes (/sleep, /collective_rpc, the weight
routes) and the pickled IPC handles they take would let any client that
reaches them run code in the server.

On the driver: one trainer rank per GPU (a Ray actor of your own class, in one
process group, with a send_weights() method that calls its WeightSender),
the server on the same GPUs, then each round:

    trainers, pg = start_trainers(MyTrainer, num_gpus, trainer_args=(...))
    gpu_ids = [p["gpu_ids"][0] for p in placements(trainers)]   # pin the server to the trainers' GPUs
    with serving([model_path, *serve_args(model_name, gpu_ids)], socket_path=private_dir / "vllm.sock",
                 log_path="vllm-server.log") as server:
        wait_until_healthy(server, timeout_s=1200)
        sock = server.socket_path
        # in every rank, once: source = sources.weight_source(model, world_size, loader)   # weight_sync/sources.py
        #                      sender = weight_sender(rank, sources.sync_client(sock, loader, source, uuids), source)
        freed = sleep_for_sync(sock, level=0, free_kv_cache=True)   # /sleep (+ /release_kv_cache_memory): train now
        wake_weights(sock, level=0)                                 # /wake_up?tags=weights (levels 1, 2)
        send_all(trainers, sock, retries=1)                         # every rank's send_weights(): sender.send()
        # if freed: every rank's torch.cuda.empty_cache() first
        wake_to_serve(sock, kv_cache=freed)                         # /wake_up?tags=kv_cache&tags=scheduling

Public names:
  the server       serve_args, start_server, serving, wait_until_healthy, stop_server, Server, ServerError
  its routes       health, sleep_for_sync, wake_weights, wake_to_serve, completions (post_completions,
                   openai_client: the openai client), collective_rpc, request (any other route)
  the trainers     start_trainers, placements, ray_get_all, send_all, wait_until_ready, leave_ray
  a trainer rank   weight_sender (WeightSender) around a vLLM WeightSource (weight_sync/sources.py's
                   weight_source and sync_client: the checkpoint form, the direct loader)
  more nodes       gloo_interface_env; the other nodes' servers are in weight_sync/multinode.py

Any HTTP client reaches the server through the socket, e.g.
`curl --unix-socket <socket> http://localhost/health`, or
`openai.OpenAI(base_url="http://localhost/v1", api_key="-",
http_client=httpx.Client(transport=httpx.HTTPTransport(uds=<socket>)))`.
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
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
import torch.distributed as dist


# Every call that can wait on the server (a chunk of weights included) gives
# up after this long: well inside the trainers' 10-minute collective timeout,
# so a hung server is reported as such, not as a dead trainer.
SERVER_CALL_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or answered a route with an error."""


# ---------------------------------------------------------------------------
# The server process
# ---------------------------------------------------------------------------

# Run the CLI through Python: it works where no `vllm` console script is installed.
DEFAULT_LAUNCHER = (sys.executable, "-m", "vllm.entrypoints.cli.main")

# The dev routes (/sleep, /wake_up, /collective_rpc, weight transfer) exist
# only in dev mode, and the IPC handles arrive pickled, which vLLM refuses to
# unpickle unless told to. Both are safe only because nobody but this user
# can reach the server (see start_server).
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}

# For a faster start, unless this process's environment says otherwise: vLLM's
# engine processes forked from its API server, which has imported vLLM already
# (spawned, each imports it again); and one Triton cache for every run (a run
# that compiles keeps Triton's kernels in vLLM's compile cache, a later run that
# loads that compiled code looks for them in Triton's own cache, and compiles
# them all again).
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
    # The write end of the watchdog's `alive` pipe, the read end of its `done` pipe (start_server).
    watchdog_fds: tuple[int, int] | None = field(default=None, repr=False)

    @property
    def pgid(self) -> int:
        # start_new_session=True makes the server the leader of its own group.
        return self.proc.pid


KV_BLOCK_TOKENS = 16  # vLLM's smallest KV cache block (tokens)


def serve_args(served_name: str, gpu_ids: list[str], *, num_nodes: int = 1, tensor_parallel_size: int = 1,
               experts: bool = True, gpu_memory_utilization: float = 0.35, kv_cache_memory_bytes: int | None = None,
               kv_cache_tokens: int | None = None, enforce_eager: bool = False, max_model_len: int | None = None,
               node: int = 0,
               head: tuple[str, int] | None = None,
               worker_extension: str = "weight_sync.direct_load.DirectLoadWorker",
               rollout_dtype: str = "bf16") -> list[str]:  # fmt: skip
    """`vllm serve` flags after the model's path, for the engines on one
    node's GPUs (`gpu_ids`, as many on each of `num_nodes` nodes): one DP
    engine per TP group, experts (if the model has them) split over every GPU
    of every node, dummy weights (the trainer sends the real ones), memory it
    can release while the trainer works, IPC weight transfer, the direct
    loader (`worker_extension`, reached through /collective_rpc). On more
    nodes, node 0 runs the API server and its engines, every other node its
    engines alone (--headless), which reach node 0's at `head` (address, port).
    `rollout_dtype` "fp8": vLLM serves the routed experts in block-wise FP8
    (e4m3, one scale per 128 x 128 block, quantized from the bf16 weights it
    receives at every sync), through its Triton MoE kernel, the layout the
    direct loader writes; everything else stays bf16.

    The KV cache: `kv_cache_memory_bytes`, or `kv_cache_tokens` (counted in
    vLLM's smallest blocks, 16 tokens; a backend with larger blocks holds
    more), else what `gpu_memory_utilization` leaves. Size it for the batch:
    every sync resets vLLM's prefix cache, a loop over every block, which
    takes 0.2-0.3 s for the ~40 GiB a 0.35 share of an H200 leaves."""
    if kv_cache_memory_bytes and kv_cache_tokens:
        raise ValueError("pass kv_cache_memory_bytes or kv_cache_tokens, not both")
    dp_size = len(gpu_ids) * num_nodes // tensor_parallel_size
    # fmt: off
    flags = [
        "--served-model-name", served_name,
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--data-parallel-size", str(dp_size),
        *(["--enable-expert-parallel"] if experts else []),
        "--device-ids", ",".join(gpu_ids),
        "--enable-sleep-mode",
        "--load-format", "dummy",
        "--weight-transfer-config", json.dumps({"backend": "ipc"}),
        "--worker-extension-cls", worker_extension,
        "--gpu-memory-utilization", str(gpu_memory_utilization),
    ]
    if num_nodes > 1:
        local = dp_size // num_nodes
        flags += ["--data-parallel-size-local", str(local), "--data-parallel-address", head[0],
                  "--data-parallel-rpc-port", str(head[1])]
        if node > 0:
            flags += ["--headless", "--data-parallel-start-rank", str(node * local)]
    # fmt: on
    if rollout_dtype == "fp8":
        flags += ["--quantization", "online", "--quantization-config", json.dumps({"moe": "fp8_per_block"}),
                  "--moe-backend", "triton"]
    elif rollout_dtype != "bf16":
        raise ValueError(f"rollout_dtype must be 'bf16' or 'fp8', not {rollout_dtype!r}")
    if enforce_eager:
        flags.append("--enforce-eager")
    if max_model_len:
        flags += ["--max-model-len", str(max_model_len)]
    if kv_cache_memory_bytes:
        flags += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    if kv_cache_tokens:
        flags += ["--num-gpu-blocks-override", str(-(-kv_cache_tokens // KV_BLOCK_TOKENS))]
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
    """Start `vllm serve <serve_args>` listening on `socket_path`, in its own
    process group, with its output in `log_path`. The socket's directory must
    be private to this user (0700, as tempfile.mkdtemp makes it); vLLM's ZMQ
    sockets go there too. `env` goes over SERVER_ENV_DEFAULTS, this process's
    environment and SERVER_ENV; Ray's GPU mask is dropped (choose GPUs with
    `--device-ids`). A watchdog (server_watchdog) stops the whole group
    once this process is gone, however it ended, and then the processes in
    `also_stop` ("PID:START" strings)."""
    socket_path = os.fspath(socket_path)
    folder = os.stat(os.path.dirname(os.path.abspath(socket_path)))
    if folder.st_uid != os.getuid() or stat.S_IMODE(folder.st_mode) & 0o077:
        raise ServerError(f"the server's socket must be in a directory private to you (0700): {socket_path}")
    if len(socket_path.encode()) > 100:  # the kernel's limit for a socket path is 107 bytes
        raise ServerError(f"socket path too long for a Unix socket ({len(socket_path)} bytes): {socket_path}")
    if len(os.path.dirname(os.path.abspath(socket_path)).encode()) > 70:  # + vLLM's "/<uuid4>" for its ZMQ sockets
        raise ServerError(f"the socket's directory is too long for vLLM's own sockets in it (over 70 bytes): "
                          f"{os.path.dirname(socket_path)}; set TMPDIR to a shorter directory")  # fmt: skip
    log_path = Path(log_path)
    full_env = {**SERVER_ENV_DEFAULTS, **os.environ, **SERVER_ENV, **(env or {})}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    # vLLM's own processes talk over ZMQ sockets it creates under this
    # directory (/tmp by default, with the umask's modes: a user of the same
    # group could connect, and its decoders unpickle what the dev routes
    # accept). In the socket's private directory, nobody else can reach them.
    full_env["VLLM_RPC_BASE_PATH"] = os.path.dirname(os.path.abspath(socket_path))
    cmd = [*launcher, "serve", *serve_args, "--uds", socket_path]
    if shutil.which(cmd[0], path=os.pathsep.join(os.get_exec_path(full_env))) is None:
        # What Popen would raise: the watchdog's exec fails only in the child.
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd[0])
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc, watchdog_fds = _start_watched(cmd, log, full_env, also_stop)
    return Server(proc=proc, socket_path=socket_path, log_path=log_path, watchdog_fds=watchdog_fds)


def _start_watched(cmd: list[str], log, env: dict[str, str],
                   also_stop: Sequence[str] = ()) -> tuple[subprocess.Popen, tuple[int, int]]:  # fmt: skip
    """Popen(cmd) as the leader of a new process group, through the watchdog
    program (server_watchdog), which forks the watchdog off (outside the
    group) and then execs `cmd`: the Popen is the server itself. The group
    holds the server's API servers, engine cores and DP coordinator, so
    stop_server and the watchdog can signal every one of them.

    Two pipes: only this process holds the write end of `alive`, so the
    watchdog reads EOF when this process is gone; only the watchdog holds the
    write end of `done`, so stop_server reads EOF when the watchdog is gone."""
    alive_r, alive_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _watchdog_program(), WATCHDOG_MARKER, str(alive_r), str(done_w),
             str(_WATCHDOG_GRACE_S), *([",".join(also_stop)] if also_stop else []), "--", *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            pass_fds=(alive_r, done_w),
        )  # fmt: skip
    except BaseException:
        os.close(alive_w)
        os.close(done_r)
        raise
    finally:
        os.close(alive_r)
        os.close(done_w)
    return proc, (alive_w, done_r)


# The watchdog's grace between SIGTERM and SIGKILL once the starting process is gone.
_WATCHDOG_GRACE_S = 10.0
# The watchdog's first argument (its sys.argv[1]): what tells its processes apart by their command line.
WATCHDOG_MARKER = "helpers.server_watchdog"


def _watchdog_program() -> str:
    """The watchdog as a program of its own: server_watchdog and the /proc
    functions it calls, from this file's source, with the standard library
    alone (it starts fast and holds next to no memory)."""
    import inspect

    parts = [inspect.getsource(f) for f in (proc_stat, start_time, group_members, server_watchdog)]
    return "\n".join(["from __future__ import annotations", "import os, select, signal, sys, time", *parts,
                      "server_watchdog()"])  # fmt: skip


def _release_watchdog(server: Server, timeout_s: float = 10.0) -> None:
    """Close the server's `alive` pipe (its watchdog then stops what is left of
    the group, and exits), and wait until the watchdog is gone."""
    if server.watchdog_fds is None:
        return
    (alive_w, done_r), server.watchdog_fds = server.watchdog_fds, None
    try:
        os.write(alive_w, b"r")  # a release, not the caller's death: leave its `also_stop` alone
    except OSError:
        pass
    os.close(alive_w)
    try:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([done_r], [], [], left)
            if ready and not os.read(done_r, 4096):  # EOF: the watchdog exited
                break
    finally:
        os.close(done_r)


# ---------------------------------------------------------------------------
# The watchdog: a program of its own (_watchdog_program), standard library only
# ---------------------------------------------------------------------------


def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the process name (state, ppid,
    pgrp, ...; start time is [19]), None if the process is gone. Bytes: a
    process name need not be UTF-8."""
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


def server_watchdog() -> None:
    """python -c <_watchdog_program()> helpers.server_watchdog ALIVE_FD DONE_FD GRACE_S [ALSO] -- CMD [ARGS...]

    Run by start_server as the leader of the server's new process group: it
    forks off a watchdog into a session of its own, outside that group, then
    execs CMD, which keeps this PID (the caller's Popen is the server itself:
    its pid is the group's id, poll() its exit code).

    The watchdog reads EOF on ALIVE_FD, a pipe whose write end only the caller
    holds, once the caller is gone however it ended (SIGKILL included), or
    when stop_server closes it. Then it SIGTERMs the group, SIGKILLs what is
    left after GRACE_S, and exits once the group is empty, as it also does
    when the group empties on its own. Its exit closes DONE_FD, which only it
    holds. ALSO ("PID:START,...") names other processes the caller started
    that must not outlive it (a local Ray's agents outlive a SIGKILLed driver
    by minutes): SIGKILLed only if the caller is gone, not when stop_server
    lets the watchdog go (it writes "r" first); START keeps a reused PID safe."""

    def say(text: str) -> None:
        try:
            os.write(2, f"[server_watchdog] {text}\n".encode())
        except OSError:
            pass

    def wait_gone(pgid: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while group_members(pgid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def stop_group(pgid: int, grace_s: float) -> None:
        if not group_members(pgid):
            return
        say(f"the process that started the vLLM server is gone: stopping its process group {pgid}")
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            if wait_gone(pgid, wait_s):
                return
        say(f"processes {group_members(pgid)} of group {pgid} survived SIGKILL")

    def watch(pgid: int, alive_fd: int, leader_fd: int | None, grace_s: float, also: list[str]) -> None:
        """Until the caller is gone (EOF on alive_fd) or the group is empty."""
        leader_alive, released = True, False
        while True:
            # While the leader runs, block on its pidfd; after that (its
            # engines may live on), look at the group once a second.
            waiting = [alive_fd] + ([leader_fd] if leader_alive and leader_fd is not None else [])
            timeout = None if (leader_alive and leader_fd is not None) or also else 1.0
            try:
                ready, _, _ = select.select(waiting, [], [], timeout)
            except InterruptedError:
                continue
            if alive_fd in ready:
                try:
                    data = os.read(alive_fd, 4096)
                except OSError:
                    data = b""
                released = released or b"r" in data  # stop_server says so before it lets go
                if not data:  # EOF: the caller is gone, or stop_server let go
                    stop_group(pgid, grace_s)
                    if also and not released:  # the caller is gone: what else it started goes too
                        say(f"stopping {len(also)} other processes the caller started")
                        for pid, start in (entry.split(":") for entry in also):
                            if start_time(int(pid)) == start:  # still that same process
                                try:
                                    os.kill(int(pid), signal.SIGKILL)
                                except ProcessLookupError:
                                    pass
                    return
            if leader_fd is not None and leader_fd in ready:
                leader_alive = False
            # An empty group ends the watch, unless other processes are in our
            # care: then only the caller's release or death does.
            if (not leader_alive or leader_fd is None) and not also and not group_members(pgid):
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
        # The watchdog, twice forked: a session and group of its own, so the
        # server's group holds only the server's processes and signals to it
        # never reach here; not a child of the server, which would not reap it.
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_IGN)
            fd = os.open(os.devnull, os.O_RDONLY)
            os.dup2(fd, 0)
            os.close(fd)
            watch(leader, alive_fd, leader_fd, float(grace_s), also)
        except BaseException as e:  # noqa: BLE001 - say it in the server's log, whatever it was
            say(f"failed: {e!r}")
            os._exit(1)
        os._exit(0)  # closes done_fd: the caller sees the watchdog gone
    # The server: wait until the watchdog is out of the group, let go of its
    # ends of the pipes, and become the server.
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
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


# What a starting `vllm serve` (0.32) is doing, from the first log line that
# says so, in the order they come. Only for progress lines: a milestone whose
# wording changes is not shown, nothing else depends on it.
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
    """Print each START_MILESTONES line the server's log has reached since
    the last call, with the seconds since its start."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return
    for needle, label in START_MILESTONES:
        if label not in server.milestones_shown and needle in text:
            server.milestones_shown.add(label)
            print(f"[server] {time.monotonic() - server.started_at:5.0f} s: {label}", flush=True)


def wait_until_healthy(server: Server, timeout_s: float = 900, poll_s: float = 1.0, also_check=None) -> float:
    """Block until GET /health answers 200, printing the server's progress
    (print_progress) meanwhile; return seconds since start.

    Raises ServerError at once if the process exits, or when the deadline
    passes, quoting the end of the server's log either way. `also_check()`,
    if given, runs every poll, and may raise to stop the wait (e.g. when a
    server on another node has exited).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        print_progress(server)
        code = server.proc.poll()
        if code is not None:
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
                f"vLLM server not healthy after {timeout_s:.0f}s; last lines of "
                f"{server.log_path}:\n{log_tail(server)}"
            )
        time.sleep(poll_s)


def _wait_group_gone(server: Server, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while group_members(server.pgid):
        server.proc.poll()  # reap the parent so it does not linger as a zombie
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stop_server(server: Server, grace_s: float = 20.0) -> None:
    """SIGTERM the server's whole process group, SIGKILL what is left after
    `grace_s`, and wait until every process is gone, its watchdog included.
    Safe to call twice."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(server.pgid, sig)
        except ProcessLookupError:
            break
        if _wait_group_gone(server, wait_s):
            break
    else:
        raise ServerError(f"processes {group_members(server.pgid)} of the vLLM server survived SIGKILL")
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    _release_watchdog(server)
    _forget_client(server.socket_path)


@contextmanager
def serving(serve_args: Sequence[str], **start_kwargs):
    """start_server(serve_args, **start_kwargs) and yield the server, still
    starting (wait_until_healthy, once you have done what can overlap its
    start); on the way out, stop it, saying so and quoting its log if it had
    exited on its own."""
    server = start_server(serve_args, **start_kwargs)
    try:
        yield server
    finally:
        with signals_ignored():
            if server.proc.poll() is not None:
                print(f"[shutdown] the vLLM server had exited with code {server.proc.returncode}; "
                      f"last lines of {server.log_path}:\n{log_tail(server, 15)}", flush=True)  # fmt: skip
            print("[shutdown] stopping the vLLM server", flush=True)
            try:
                stop_server(server)
            except ServerError as e:  # say it, and keep the error that brought us here
                print(f"[shutdown] {e}", flush=True)


@contextmanager
def signals_ignored():
    """Let a cleanup finish: a second Ctrl-C, SIGTERM or SIGHUP meanwhile
    would otherwise cut it short and leave processes behind."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = [signal.signal(sig, signal.SIG_IGN) for sig in sigs]
    try:
        yield
    finally:
        for sig, handler in zip(sigs, previous, strict=True):
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------
# HTTP routes: one small function each. `sock` is the server's socket path.
# ---------------------------------------------------------------------------


# One client per server socket and process, its connection kept open between
# calls: a round makes a handful of calls milliseconds apart, and a new client
# for each would build a transport and connect anew each time.
_clients: dict[tuple[int, str], httpx.Client] = {}


def _client(sock: str) -> httpx.Client:
    key = (os.getpid(), sock)  # (a forked child opens its own connection)
    if key not in _clients:
        # Plain HTTP over a local socket: no TLS context to build (loading the
        # CA certificates costs ~30 ms) and no proxy. An idle connection is
        # dropped at half the server's keep-alive timeout (vLLM's
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default), so it is never reused
        # just as the server closes it.
        idle_s = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")) / 2
        transport = httpx.HTTPTransport(uds=sock, verify=False, limits=httpx.Limits(keepalive_expiry=idle_s))
        _clients[key] = httpx.Client(transport=transport, base_url="http://localhost", trust_env=False)
    return _clients[key]


def _forget_client(sock: str, close: bool = True) -> None:
    """Drop this process's client for a server: closed (the server stopped),
    or left to a call another thread may still be making on it."""
    client = _clients.pop((os.getpid(), sock), None)
    if client is not None and close:
        client.close()


def request(sock: str, method: str, route: str, timeout: float = SERVER_CALL_TIMEOUT_S, **kwargs) -> Any:
    """Call any route (httpx's keyword arguments); return its JSON; raise
    ServerError with the server's own error text."""
    try:
        resp = _client(sock).request(method, route, timeout=timeout, **kwargs)
    except httpx.HTTPError as e:
        _forget_client(sock, close=False)
        raise ServerError(f"{method} {route} failed: {e!r}") from e
    if resp.status_code != 200:
        # vLLM's server may reset a connection after an error reply (seen
        # after an HTTP 500): the next call starts on a new one.
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
    """POST /sleep: level 0 only pauses scheduling; level 1 also offloads the
    weights to CPU, level 2 discards them; both free the KV cache."""
    return request(sock, "POST", "/sleep", params={"level": level})


def release_kv_cache(sock: str) -> dict:
    """POST /release_kv_cache_memory: after /sleep?level=0, give the KV
    cache's GPU memory back (the weights stay); /wake_up?tags=kv_cache maps it
    again. Resets the prefix cache, whose entries the old weights computed."""
    return request(sock, "POST", "/release_kv_cache_memory")


def sleep_for_sync(sock: str, level: int, free_kv_cache: bool = True) -> bool:
    """Stop serving until the sync. At level 0 the weights stay mapped (the
    send overwrites them in place) and, with `free_kv_cache`, the KV cache's
    memory goes to the trainer (for a training step); without, only the
    prefix cache is reset, since the old weights computed its entries:
    nothing to unmap now and map back later (vLLM's reset still visits
    every block of the cache). Levels 1 and 2 free
    the KV cache and the weights. Returns whether the KV cache is freed (what
    wake_to_serve must map back)."""
    sleep(sock, level)
    if level == 0:
        if free_kv_cache:
            release_kv_cache(sock)
        else:
            reset_prefix_cache(sock)
    return level > 0 or free_kv_cache


def reset_prefix_cache(sock: str) -> None:
    """POST /reset_prefix_cache: forget the cached prompts' KV entries."""
    request(sock, "POST", "/reset_prefix_cache")


def wake_weights(sock: str, level: int) -> None:
    """POST /wake_up?tags=weights: map the weights back before the send,
    unless level 0 kept them mapped."""
    if level > 0:
        wake_up(sock, ["weights"])


def wake_up(sock: str, tags: Iterable[str] | None = None) -> dict:
    """POST /wake_up?tags=...: map back the named memory pools (all if None)."""
    params = [("tags", t) for t in tags] if tags else None
    return request(sock, "POST", "/wake_up", params=params)


def wake_to_serve(sock: str, kv_cache: bool = True) -> None:
    """POST /wake_up?tags=kv_cache&tags=scheduling: the KV cache back (unless
    the sleep kept it), the scheduler running; raise unless the server is then
    fully awake."""
    try:
        state = wake_up(sock, ["kv_cache", "scheduling"] if kv_cache else ["scheduling"])
    except ServerError as e:
        raise ServerError(wake_failure(str(e), kv_cache)) from e
    if state["status"] != "awake":
        raise ServerError(f"server still asleep after the last wake_up: {state}")


def wake_failure(error: str, kv_cache: bool) -> str:
    """What a failed wake_up means, in front of the server's own words: out
    of memory while mapping a freed KV cache back is memory taken meanwhile."""
    if kv_cache and "out of memory" in error.lower():
        return ("vLLM could not map its KV cache back: the GPU's memory it freed was taken meanwhile (by "
                "another process on the GPU, or kept by the trainer); keep the KV cache through the sync, or "
                f"make it smaller: {error}")
    return error


def is_sleeping(sock: str) -> bool:
    return request(sock, "GET", "/is_sleeping")["is_sleeping"]


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]


def openai_client(sock: str):
    """The openai client for vLLM's OpenAI-compatible routes, over the server's
    socket (this process's connection to it). `requests` cannot reach a Unix
    socket, and the socket is what keeps other users out."""
    import openai

    transport = _client(sock)
    made = _openai_clients.get(id(transport))
    if made is None or made[0] is not transport:  # (a dropped connection's client goes with it)
        made = _openai_clients[id(transport)] = (transport, openai.OpenAI(
            base_url="http://localhost/v1", api_key="-", max_retries=0, http_client=transport))  # fmt: skip
    return made[1]


_openai_clients: dict[int, tuple] = {}


def post_completions(sock: str, dp_rank: int | None = None, **fields):
    """POST /v1/completions through the openai client (`fields` as its
    `completions.create` takes them; vLLM's own through `extra_body`);
    `dp_rank` pins it to one DP engine. Raises ServerError with the server's
    own error text."""
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
    sock: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    temperature: float = 0.0,
    dp_rank: int | None = None,
) -> list[Completion]:
    """One completion per prompt (greedy by default), with the prompt's and
    the output's token ids (vLLM's return_token_ids)."""
    out = post_completions(sock, dp_rank, model=model, prompt=prompts, max_tokens=max_tokens,
                           temperature=temperature, extra_body={"return_token_ids": True})  # fmt: skip
    by_index = {c.index: c for c in out.choices}
    return [
        Completion(c.text, list(c.prompt_token_ids), list(c.token_ids))
        for c in (by_index[i] for i in range(len(prompts)))
    ]


def collective_rpc(sock: str, method: str, *args: str, timeout: float = SERVER_CALL_TIMEOUT_S) -> list:
    """POST /collective_rpc: call `method` on the worker of every engine
    (string arguments only). Returns the first DP engine's results; an error
    on any engine fails the call."""
    body = {"method": method, "args": list(args), "timeout": timeout}
    out = request(sock, "POST", "/collective_rpc", timeout=timeout + 10, json=body)
    return out["results"] if out else []


# ---------------------------------------------------------------------------
# Weight sync clients: what vLLM's IPC trainer engine calls on trainer rank 0
# ---------------------------------------------------------------------------


def weight_sync_client(sock: str):
    """vLLM's HTTPVLLMWeightSyncClient (its /start_weight_update,
    /update_weights, /finish_weight_update routes), over the Unix socket, and
    raising ServerError with the server's reply instead of a bare HTTP status."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class WeightSyncClient(HTTPVLLMWeightSyncClient):
        def _post(self, path: str, json: dict | None = None) -> None:
            request(sock, "POST", f"/{path}", timeout=self.timeout, json=json)

    return WeightSyncClient(sock, timeout=SERVER_CALL_TIMEOUT_S)


class FailAfterSend:
    """Rank 0's weight sync client, made safe to retry. Every rank meets at a
    barrier per chunk and only rank 0 calls the client: had a call raised,
    rank 0 would leave while the others wait at the next barrier (for the
    10-minute collective timeout). So after a failed call the send's other
    updates are skipped, `finish_weight_update` still runs (the direct
    loader's finish closes its session), and `raise_failure()` raises the
    first error once every rank is through (send_all retries then)."""

    def __init__(self, client) -> None:
        self.client, self._failure = client, None  # (the client it wraps)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)  # at setup, not in a send: raise now

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

    def __getattr__(self, name: str):  # anything else vLLM may call
        return getattr(self.client, name)

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except ServerError as e:
            self._failure = self._failure or e


# ===========================================================================
# The trainer ranks: one Ray actor per GPU, in one process group
# ===========================================================================

# Every rank takes part in collectives, so a call is made on all of them at
# once and must not wait on a rank that is gone (ray_get_all).

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # longer than any server call (SERVER_CALL_TIMEOUT_S)


class PlacementError(RuntimeError):
    """Ray cannot give every trainer rank its GPU on the nodes asked for."""


class TrainerDied(RuntimeError):
    """A trainer rank's process died (killed, out of memory, crashed)."""


# A trainer rank is an object of any class, started as a Ray actor by
# start_trainers, which runs these functions in it (Ray's __ray_call__), so
# that the class needs no base class; send_all calls its send_weights().

_store = None  # rank 0's: the store the ranks meet at
_listener = None  # rank 0 on more nodes: the TCP socket its store listens on


def open_rendezvous(host: str, world_size: int) -> str | int:
    """Rank 0: open the store where the ranks meet; returns where the
    others find it (for join_process_group). One node (`host` 127.0.0.1):
    a torch FileStore in a 0700 directory of its own (no port any local
    user could connect to); returns the file's path, which must stay while
    the ranks run (leave_ray, remove_rendezvous). More nodes (`host`: rank
    0's address): a TCPStore, bound by us on that one address only (torch's
    own listens on every interface, and has no authentication: the job
    needs a network you trust); returns the port."""
    global _store, _listener
    if host == "127.0.0.1":
        folder = Path(tempfile.mkdtemp(prefix="rlhf-ipc-rendezvous-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)  # if this rank ends normally
        path = folder / "store"
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))  # ours, before torch opens it
        _store = file_store(path, world_size)
        return str(path)
    _listener = socket.create_server((host, 0))
    port = _listener.getsockname()[1]
    _store = dist.TCPStore(host, port, world_size, is_master=True, master_listen_fd=_listener.fileno(),
                           wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    return port


def join_process_group(rank: int, world_size: int, host: str, where: str | int) -> None:
    """Join the process group at what rank 0's open_rendezvous returned:
    the store's file (one node) or its port on `host`. On a GPU (Ray made
    this rank's the only one visible) CUDA tensors (FSDP2) go over NCCL, the
    rest over gloo: vLLM's IPC engine syncs every chunk with
    all_gather_object + barrier on this group, which then wait on the host
    instead of spinning an NCCL kernel on the GPU that the colocated engine
    is copying on. (No device_id: it would bind the barrier to NCCL.)"""
    if rank == 0:
        store = _store
    elif isinstance(where, str):
        store = file_store(where, world_size)
    else:
        store = dist.TCPStore(host, where, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    if host != "127.0.0.1":  # more than one node: gloo on the interface the other nodes reach
        os.environ.update(gloo_interface_env(ray.util.get_node_ip_address()))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", store=store,
                            rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)  # fmt: skip


def placement() -> dict:
    """Which GPU, on which node, Ray gave this rank (called in it, after join_process_group)."""
    info = {"rank": dist.get_rank(), "pid": os.getpid(), "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "node": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_name=props.name, gpu_uuid=str(props.uuid))
    return info


def placements(trainers: list) -> list[dict]:
    """placement() of every trainer rank."""
    return ray_get_all([t.__ray_call__.remote(_in_rank, placement) for t in trainers])


def _in_rank(_trainer, fn, *args):
    """What __ray_call__ runs in a rank: `fn(*args)`, without the trainer object."""
    return fn(*args)


def file_store(path: str | os.PathLike, world_size: int) -> dist.FileStore:
    """Torch's FileStore at `path` for `world_size` ranks, with the collectives' timeout.
    (It opens the file again for every operation: its directory must outlive the ranks.)"""
    store = dist.FileStore(str(path), world_size)
    store.set_timeout(COLLECTIVE_TIMEOUT)
    return store


_rendezvous_dirs: dict[str, Path] = {}  # placement group id -> its trainers' one-node store's directory


def remove_rendezvous(pg) -> None:
    """Remove the directory of the one-node store that `pg`'s trainers met
    at (call it when they are gone, or going: they open it on every use)."""
    if (where := _rendezvous_dirs.pop(pg.id.hex(), None)) is not None:
        shutil.rmtree(where, ignore_errors=True)


@atexit.register
def _remove_rendezvous_left() -> None:
    """At this process's exit, what remove_rendezvous was not called for:
    Ray stops a job's trainers with its driver."""
    for where in _rendezvous_dirs.values():
        shutil.rmtree(where, ignore_errors=True)


def start_trainers(trainer_cls: type, num_trainers: int, num_nodes: int = 1, gpus_per_trainer: float = 1,
                   placement_timeout_s: float = 60, trainer_args: tuple = ()) -> tuple[list, object]:  # fmt: skip
    """Reserve one GPU per trainer rank, the same number on each of
    `num_nodes` nodes, the first of them this one (where vLLM's API server
    and trainer rank 0 run); start the ranks in node order, each an actor of
    `trainer_cls` (any class, or one that is a Ray actor already:
    `@ray.remote`), built with `trainer_args`; and join them in one
    torch.distributed process group (dist.get_rank() in each is its rank).
    Returns (trainers, placement group). Raises PlacementError if Ray cannot
    place them in time."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    have = ray.cluster_resources().get("GPU", 0)
    if gpus_per_trainer and have < num_trainers * gpus_per_trainer:
        raise PlacementError(f"asked for {num_trainers} GPUs but the Ray cluster has {have:g}")
    per_node = num_trainers // num_nodes
    here = ray.get_runtime_context().get_node_id()
    here_gpus = next(n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == here)
    if here_gpus < per_node * gpus_per_trainer:
        raise PlacementError(f"this node has {here_gpus:g} GPUs in Ray, and needs {per_node * gpus_per_trainer:g}: "
                             "run the script on a GPU node (it runs vLLM's API server and trainer rank 0)")  # fmt: skip
    # One bundle per node. CUDA IPC only works between processes on one machine, so every
    # trainer rank shares its node with the engine on its GPU: STRICT_PACK puts one node's
    # ranks together, STRICT_SPREAD the nodes apart; the first node is this one.
    bundle = {"CPU": per_node, **({"GPU": per_node * gpus_per_trainer} if gpus_per_trainer else {})}
    pg = placement_group([bundle] * num_nodes, strategy="STRICT_SPREAD" if num_nodes > 1 else "STRICT_PACK",
                         bundle_label_selector=[{"ray.io/node-id": here}] + [{}] * (num_nodes - 1))  # fmt: skip
    if not pg.wait(timeout_seconds=placement_timeout_s):
        ray.util.remove_placement_group(pg)
        raise PlacementError(
            f"Ray could not place {num_trainers} trainers on {num_nodes} node(s) ({bundle} on each, the first "
            f"one this node) within {placement_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
        )
    actor = trainer_cls if isinstance(trainer_cls, ray.actor.ActorClass) else ray.remote(trainer_cls)
    try:
        trainers = [
            actor.options(num_cpus=1, num_gpus=gpus_per_trainer, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=r // per_node)).remote(*trainer_args)
            for r in range(num_trainers)
        ]  # fmt: skip
        # One node: rendezvous on loopback. More: on rank 0's address, which the other nodes reach.
        host = "127.0.0.1" if num_nodes == 1 else ray.util.get_node_ip_address()
        where = ray_get_all([trainers[0].__ray_call__.remote(_in_rank, open_rendezvous, host, num_trainers)])[0]
        if isinstance(where, str):  # one node, this one: the store's file, in a directory of its own
            _rendezvous_dirs[pg.id.hex()] = Path(where).parent
        ray_get_all([t.__ray_call__.remote(_in_rank, join_process_group, r, num_trainers, host, where)
                     for r, t in enumerate(trainers)])  # fmt: skip
    except BaseException:  # a rank that did not start, or Ctrl-C: the caller never gets the group to remove
        ray.util.remove_placement_group(pg)  # and its trainers with it
        remove_rendezvous(pg)
        raise
    return trainers, pg


def gloo_interface_env(node_ip: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for a process that talks gloo to other nodes: the
    network interface that holds this node's cluster address. Without it,
    gloo binds the address the host's name resolves to, on many
    distributions 127.0.1.1, which no other node reaches. A value the user
    set wins."""
    import psutil  # a Ray dependency

    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = [name for name, addrs in psutil.net_if_addrs().items() if any(a.address == node_ip for a in addrs)]
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


def leave_ray(started_ray: bool, pg) -> None:
    """Leave Ray as we found it: shut down if we started it (again is a no-op),
    else our placement group removed, and the trainers with it; and their
    one-node rendezvous directory."""
    if started_ray:
        ray.shutdown()
    elif pg is not None:
        ray.util.remove_placement_group(pg)
    if pg is not None:
        remove_rendezvous(pg)


def ray_get_all(refs: list, who: str = "a trainer rank", also_check=None):
    """ray.get(refs), but raise as soon as any one fails: the others may be
    blocked in a collective waiting for it. A ServerError (the server
    refused or died) is raised as itself, prefixed by `who` raised it; a dead
    actor (`who`'s process) as TrainerDied. `also_check()`, if given, runs
    every 2 s while they run, and may raise to stop the wait."""
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
    """The first line of Ray's report, and the error that killed the actor if
    it names one (e.g. CUDA out of memory in the constructor)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return lines[0] + (f" ... {cause[-1]}" if cause and cause[-1] != lines[0] else "")


def send_all(trainers: list, sock: str, retries: int = 0, check_failure=None) -> tuple[list, int]:
    """send_weights() on every rank; returns what each rank reports and how
    many times the send was retried. A send the server failed part way (an
    HTTP error, a refused chunk, a timeout) is sent again from the start, up to
    `retries` times: vLLM is still asleep, and every weight is re-sent. A dead
    rank (TrainerDied) or a dead server is not retried: the server must
    answer, and `check_failure(error)`, if given, runs at every failed send
    (`error`: the send's, as if not retried) and may raise in its place, naming
    a cause found elsewhere (on more nodes: another node's server exited)."""
    first = why = None
    for attempt in range(retries + 1):
        sends = [t.send_weights.remote() for t in trainers]
        try:
            return ray_get_all(sends, also_check=_answering(sock)), attempt
        except ServerError as e:
            first = first or e
            if check_failure:
                check_failure(ServerError("the send failed part way (not retried); "
                                          f"vLLM holds a mix of old and new weights: {e}"))  # fmt: skip
            if attempt == retries:
                why = None if retries else "not retried"  # --send-retries 0, or vLLM's own loader (send_retries)
                break
            if not health(sock):
                why = "not retried: the server does not answer"
                break
            if len(ray.wait(sends, num_returns=len(sends), timeout=60)[0]) < len(sends):
                why = "not retried: a trainer rank is still in the send"
                break
            print(f"[send] {e}\n[send] vLLM is still asleep: sending every weight again "
                  f"(retry {attempt + 1} of {retries})", flush=True)  # fmt: skip
    detail = why or (f"{attempt + 1} tries" if attempt else "")
    raise ServerError(f"the send failed part way{f' ({detail})' if detail else ''}; "
                              f"vLLM holds a mix of old and new weights: {first}")  # fmt: skip


def _answering(sock: str):
    """A check for ray_get_all that raises once the server has failed GET
    /health twice in a row. A server whose engine died keeps its API server
    up while it waits for open requests, such as the chunk in flight, which
    then never return (until SERVER_CALL_TIMEOUT_S)."""
    misses = [0]

    def check() -> None:
        misses[0] = 0 if health(sock) else misses[0] + 1
        if misses[0] >= 2:
            raise ServerError("the vLLM server stopped answering GET /health during the send (its engine died?)")

    return check


def wait_until_ready(server: Server, filling: list, timeout_s: float, also_check=None) -> float:
    """Wait for the trainers' weights and for the server's health, printing
    its progress; a failed rank, or a server that exits, fails at once.
    `also_check()`, if given, runs every 2 s meanwhile, and may raise to stop
    the wait (on more nodes: another node's server exited). Returns when the
    last rank's weights were in, in seconds into the server's start."""
    while filling and server.proc.poll() is None:
        done, filling = ray.wait(filling, num_returns=len(filling), timeout=2)
        ray_get_all(done)
        if also_check:
            also_check()
        print_progress(server)
    filled_after_s = time.monotonic() - server.started_at
    if not filling:  # else the server exited first, and wait_until_healthy says how
        print(f"[trainers] weights in, {filled_after_s:.0f} s into the server's start", flush=True)
    left = timeout_s - filled_after_s
    server.healthy_after_s = wait_until_healthy(server, left, also_check=also_check)
    print(f"[server] healthy after {server.healthy_after_s:.1f} s at {server.socket_path}", flush=True)
    return filled_after_s


# ---------------------------------------------------------------------------
# A trainer rank's half of the sync
# ---------------------------------------------------------------------------


def metadata_bytes(metadata) -> int:
    """What tensors of this metadata (ParamMeta) take, in bytes."""
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metadata)


@dataclass
class WeightSender:
    """One trainer rank's side of the sync (weight_sender builds it, and
    keeps its arguments: another can be built around the same source)."""

    client: FailAfterSend
    engine: Any  # vLLM's IPC trainer engine
    experts_in_place: Any  # the direct loader's blocks the engines copy from this rank (sources.ExpertsInPlace)
    source: Any  # all it sends (a WeightSource): the packed part, then the blocks in place: the packed part, then the blocks in place
    rank: int
    packed: bool
    packed_buffer_size_bytes: int

    def send(self) -> None:
        """One full sync; every rank calls it at once. A server error on
        rank 0 is raised once every rank is through the send, so that the
        send can be retried (send_all)."""
        if self.experts_in_place is not None:
            self.experts_in_place.gather()  # rank 0's client hands every rank's handles to the engines
        self.engine.send_weights()
        self.client.raise_failure()


def weight_sender(rank: int, client, source, packed: bool = True,
                  packed_buffer_size_bytes: int = 4 * 1024**3) -> WeightSender:  # fmt: skip
    """vLLM's IPC trainer engine on this rank: it packs `source`'s tensors into
    one reusable IPC buffer (of `packed_buffer_size_bytes`, which must hold
    the largest tensor), and each DP engine reads its own GPU's; rank 0
    calls `client` (weight_sync_client: vLLM's routes; the direct loader's:
    weight_sync.sources.sync_client) for each chunk. `source`: a vLLM
    WeightSource (weight_sync.sources.weight_source's). The expert
    blocks a source has in place (LocalExpertSource of a bf16 trainer: the
    last it yields) skip the buffer: the engines copy them from the trainer's
    memory."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    in_place = getattr(source, "experts_in_place", None)
    if in_place is not None and getattr(client, "experts_in_place", None) is not in_place:
        in_place = None  # a client that does not hand them to the engines (vLLM's routes): they go packed
    packed_part = in_place.packed_part(source) if in_place else source  # all but the blocks in place
    told = getattr(client, "packed_bytes", None)
    if told is not None and told != (packs := metadata_bytes(packed_part.metadata)):
        raise ValueError(f"the direct loader's client expects {told} packed bytes a send and this source packs "
                         f"{packs}: build the client for this source (sync_client)")  # fmt: skip
    client = FailAfterSend(client)
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=rank, packed=packed, packed_buffer_size_bytes=packed_buffer_size_bytes),
        client=client,
        source=packed_part,
    )
    return WeightSender(client, engine, in_place, source, rank, packed, packed_buffer_size_bytes)
