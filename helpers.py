# SPDX-License-Identifier: Apache-2.0
"""Sync an FSDP2 trainer's weights into a vLLM server on the same GPUs over CUDA IPC: the server on a private
socket, its routes, and each trainer rank's send, on torch.distributed alone (torchrun's ranks or Ray actors).

Copy this file alone for vLLM's own weight loader, or with weight_sync/ for the direct loader. Anyone who reaches
the server can run code in it: it listens on a Unix socket in a directory only your user can enter. Every
trainer rank runs, with its model sharded (weight_sync/ray_trainers.py has the Ray driver's version):

    gpus = rank_gpus()  # each rank's GPU: for --device-ids, and its UUID
    with vllm_server([model_path, *serve_args(name, [g["gpu_id"] for g in gpus])], log_path="vllm.log") as sock:
        sender = weight_sender(dist.get_rank(), WeightSyncClient(sock), ModuleSource(model))  # vLLM's
        freed = on_rank_zero(sleep_for_sync, sock, level, free_kv_cache=True)  # then train in the freed memory
        on_rank_zero(wake_weights, sock, level)  # sleep levels 1 and 2 only
        sender.send(empty_cache=freed)  # every rank; sent again where the server failed part way
        on_rank_zero(wake_to_serve, sock, kv_cache=freed)
"""

from __future__ import annotations

import errno
import http.client
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

# Server calls give up after this, before the trainers' collective timeout: a hung server is named as such.
SERVER_CALL_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    """The vLLM server failed to start, died, or answered a route with an error."""


# ---- The server process ----
DEFAULT_LAUNCHER = (sys.executable, "-m", "vllm.entrypoints.cli.main")  # works without a `vllm` script

# For the dev routes and the pickled IPC handles; safe only because no other user can reach the socket.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

# Start faster: fork engines from the API server, and share the Triton cache that vLLM's compile cache uses.
SERVER_ENV_DEFAULTS = {
    "VLLM_WORKER_MULTIPROC_METHOD": "fork",
    "TRITON_CACHE_DIR": str(Path.home() / ".triton" / "cache"),
}


@dataclass
class Server:
    proc: subprocess.Popen
    socket_path: str
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    healthy_after_s: float | None = None  # set from wait_until_healthy's result
    milestones_shown: set[str] = field(default_factory=set)  # the ones print_progress has printed
    watchdog_fds: tuple[int, int] | None = field(default=None, repr=False)  # our ends: `alive`'s write, `done`'s read
    serving_after_s: float | None = None  # when a server started without flags was given them, since its start

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True makes the server the leader of its own group

    def serve(self, serve_args: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Give a server started without flags (start_server) its `vllm serve` flags, and `env` for its engines."""
        argv = ["serve", *serve_args, "--uds", self.socket_path]
        with open(self.log_path, "a") as log:
            log.write("$ vllm " + " ".join(argv) + "\n")
        with suppress(BrokenPipeError):  # it died: wait_until_healthy says so, with its log
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env or {}}) + "\n").encode())
            self.proc.stdin.close()
        self.serving_after_s = time.monotonic() - self.started_at

    def also_stop(self, processes: Sequence[str]) -> None:
        """Have the watchdog also kill `processes`, "PID:START" each, if this process dies (see start_server)."""
        if processes and self.watchdog_fds is not None:
            try:
                os.write(self.watchdog_fds[0], ("a" + ",".join(processes) + "\n").encode())
            except BrokenPipeError:  # the watchdog goes once the server's group is empty: say why the server exited
                if (code := self.proc.poll()) is None:  # or the watchdog failed, as the server's log says
                    raise ServerError(f"the vLLM server's watchdog is gone; see {self.log_path}") from None
                raise ServerError(start_failure(self, code)) from None


KV_BLOCK_TOKENS = 16  # tokens in vLLM's smallest KV cache block


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
    dummy_weights: bool = True,
) -> list[str]:
    """Return the `vllm serve` flags after the model path, for the engines on one node's `gpu_ids`.

    `gpu_ids` as `--device-ids` takes them: physical GPUs (physical_gpu_id), in the order of the trainer ranks.
    The direct loader needs `worker_extension="weight_sync.direct_load.DirectLoadWorker"`. Size the KV cache with
    `kv_cache_memory_bytes` or `kv_cache_tokens`: each sync resets all of it, about 0.25 s per 40 GiB.
    `dummy_weights`: start on random weights, as the first sync overwrites every one; else load the model's."""
    if kv_cache_memory_bytes and kv_cache_tokens:
        raise ValueError("pass kv_cache_memory_bytes or kv_cache_tokens, not both")
    dp_size = len(gpu_ids) * num_nodes // tensor_parallel_size
    flags = [
        *("--served-model-name", served_name),
        *("--tensor-parallel-size", str(tensor_parallel_size)),
        *("--data-parallel-size", str(dp_size)),
        *(["--enable-expert-parallel"] if experts else []),
        *("--device-ids", ",".join(gpu_ids)),
        "--enable-sleep-mode",
        *(("--load-format", "dummy") if dummy_weights else ()),
        *("--weight-transfer-config", json.dumps({"backend": "ipc"})),
        *("--gpu-memory-utilization", str(gpu_memory_utilization)),
    ]
    flags += ["--worker-extension-cls", worker_extension] if worker_extension else []
    if num_nodes > 1:
        local = dp_size // num_nodes
        flags += [
            *("--data-parallel-size-local", str(local)),
            *("--data-parallel-address", head[0]),
            *("--data-parallel-rpc-port", str(head[1])),
        ]
        if node > 0:  # engines only, reaching node 0's API server at `head`
            flags += ["--headless", "--data-parallel-start-rank", str(node * local)]
    if rollout_dtype == "fp8":  # vLLM quantizes the routed experts it receives to block-wise FP8
        flags += [
            *("--quantization", "online"),
            *("--quantization-config", json.dumps({"moe": "fp8_per_block"})),
            *("--moe-backend", "triton"),
        ]
    elif rollout_dtype != "bf16":
        raise ValueError(f"rollout_dtype must be 'bf16' or 'fp8', not {rollout_dtype!r}")
    flags += ["--enforce-eager"] if enforce_eager else []
    flags += ["--max-model-len", str(max_model_len)] if max_model_len else []
    flags += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)] if kv_cache_memory_bytes else []
    flags += ["--num-gpu-blocks-override", str(-(-kv_cache_tokens // KV_BLOCK_TOKENS))] if kv_cache_tokens else []
    return flags


def start_server(
    serve_args: Sequence[str] | None,
    *,
    socket_path: str | os.PathLike,
    log_path: str | os.PathLike,
    env: dict[str, str] | None = None,
    launcher: Sequence[str] = DEFAULT_LAUNCHER,
    also_stop: Sequence[str] = (),
) -> Server:
    """Start `vllm serve <serve_args>` on the Unix socket `socket_path`, without waiting for it to be healthy.

    The socket's directory must be yours alone (0700): anyone who reaches the server can run code in it. A watchdog
    stops the server once this process is gone, however it ended, and kills the processes in `also_stop`.
    With `serve_args` None the server waits for Server.serve() to give it its flags; with a `-m` launcher, such
    as the default, it imports vLLM meanwhile, the first third of its start. It touches no GPU before, so its
    start overlaps whatever comes first, such as placing the trainers and allocating their models."""
    socket_path = os.fspath(socket_path)
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.stat(folder).st_uid != os.getuid() or stat.S_IMODE(os.stat(folder).st_mode) & 0o077:
        raise ServerError(f"the server's socket must be in a directory private to you (0700): {socket_path}")
    if len(socket_path.encode()) > 100:  # the kernel's limit for a socket path is 107 bytes
        raise ServerError(f"socket path too long for a Unix socket ({len(socket_path)} bytes): {socket_path}")
    if len(folder.encode()) > 70:  # vLLM adds "/<uuid4>" for its ZMQ sockets
        raise ServerError(
            f"the socket's directory is too long for vLLM's own sockets in it (over 70 bytes): "
            f"{os.path.dirname(socket_path)}; set TMPDIR to a shorter directory"
        )
    full_env = {**SERVER_ENV_DEFAULTS, **os.environ, **SERVER_ENV, **(env or {})}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)  # `--device-ids` picks the GPUs, not Ray's mask
    # vLLM's ZMQ sockets unpickle what they receive: keep them out of /tmp, in the private directory, with its
    # other temporary files (the engines' FileStore, which a stopped engine leaves behind), to go with it.
    full_env["VLLM_RPC_BASE_PATH"] = full_env["TMPDIR"] = folder
    if serve_args is None:
        cmd = [launcher[0], "-c", _WAIT_FOR_FLAGS, *launcher[1:]]
    else:
        cmd = [*launcher, "serve", *serve_args, "--uds", socket_path]
    if shutil.which(cmd[0], path=os.pathsep.join(os.get_exec_path(full_env))) is None:
        # Raise what Popen would: started through the watchdog, a missing program fails only in the child.
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cmd[0])
    told_later = " ".join(launcher) + ", importing vLLM until Server.serve() gives it its flags"
    # The log names an allocator setting given for this server (vllm_adapter.serve_env's): PyTorch reads it at start.
    conf = "PYTORCH_CUDA_ALLOC_CONF"
    allocator = f"{conf}={full_env[conf]} " if conf in (env or {}) else ""
    Path(log_path).write_text("$ " + allocator + (" ".join(cmd) if serve_args is not None else told_later) + "\n")
    with open(log_path, "a") as log:  # appending, as Server.serve does
        proc, watchdog_fds = _start_watched(cmd, log, full_env, also_stop, serve_args is None)
    return Server(proc=proc, socket_path=socket_path, log_path=Path(log_path), watchdog_fds=watchdog_fds)


# A server started without flags: `python -c _WAIT_FOR_FLAGS -m MODULE` or `... SCRIPT` imports what `vllm serve`
# imports, then runs the launcher with the flags and environment Server.serve() writes to its standard input.
_WAIT_FOR_FLAGS = """
import json, os, runpy, sys, time
launcher = sys.argv[1:]
if launcher[0] == "-m":
    try:  # the slow part of a start, which needs no GPU: the launcher's own code, then what `vllm serve` imports
        start = time.monotonic()
        runpy.run_module(launcher[1])  # as a module, not as __main__: it does not run yet
        import vllm.entrypoints.cli.serve  # noqa: F401
        print(f"[wait for flags] vLLM imported in {time.monotonic() - start:.1f} s", flush=True)
    except Exception as e:  # only the head start is lost: the launcher imports what it needs once told
        print(f"[wait for flags] importing vLLM early failed; it imports once given its flags: {e!r}", flush=True)
told = json.loads(sys.stdin.readline() or "null")
if told is not None:
    os.environ.update(told["env"])  # read by the engines it starts, such as GLOO_SOCKET_IFNAME
    sys.argv = [launcher[-1], *told["argv"]]
    if launcher[0] == "-m":
        runpy.run_module(launcher[1], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(launcher[0], run_name="__main__")
"""


_WATCHDOG_GRACE_S = 10.0  # the watchdog's wait between SIGTERM and SIGKILL
WATCHDOG_MARKER = "helpers.server_watchdog"  # its first argument, which marks its processes' command lines


def _start_watched(
    cmd: list[str], log, env: dict[str, str], also_stop: Sequence[str] = (), stdin: bool = False
) -> tuple[subprocess.Popen, tuple[int, int]]:
    """Popen `cmd` as a new process group's leader, under a watchdog; return it and our ends of the pipes."""
    alive_r, alive_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        also = [",".join(also_stop)] if also_stop else []
        watchdog = [WATCHDOG_MARKER, str(alive_r), str(done_w), str(_WATCHDOG_GRACE_S), *also]  # server_watchdog's
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _watchdog_program(), *watchdog, "--", *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
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
    import inspect

    parts = [inspect.getsource(f) for f in (proc_stat, start_time, group_members, stop_group, server_watchdog)]
    imports = [
        "from __future__ import annotations",
        "import os, select, signal, sys, time",
        "from contextlib import suppress",
    ]
    return "\n".join([*imports, *parts, "server_watchdog()"])


def _release_watchdog(server: Server, timeout_s: float = 10.0) -> None:
    """Release the watchdog, which stops what is left of the group and exits, and wait until it is gone."""
    if server.watchdog_fds is None:
        return
    (alive_w, done_r), server.watchdog_fds = server.watchdog_fds, None
    with suppress(OSError):
        os.write(alive_w, b"r")  # a release, not our death: the watchdog leaves `also_stop` alone
    os.close(alive_w)
    try:  # readable only at EOF: the watchdog holds the only write end and never writes
        select.select([done_r], [], [], timeout_s)
    finally:
        os.close(done_r)


# ---- The watchdog, run as a program of its own by _watchdog_program: standard library only ----
def proc_stat(pid: int | str) -> list[bytes] | None:
    """Return /proc/PID/stat's fields after the name, or None if gone: [0] state, [2] group, [19] start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    """Return process `pid`'s start time in clock ticks after boot, or None if it is gone or a zombie."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] == b"Z" else stat[19].decode()


def group_members(pgid: int) -> list[int]:
    return [
        int(entry)
        for entry in filter(str.isdigit, os.listdir("/proc"))
        if (stat := proc_stat(entry)) is not None and stat[0] != b"Z" and int(stat[2]) == pgid
    ]


def stop_group(pgid: int, grace_s: float) -> list[int]:
    """SIGTERM process group `pgid`, SIGKILL it after `grace_s`; return the PIDs still alive 10 s later."""
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
    """Run as: python -c <_watchdog_program()> helpers.server_watchdog ALIVE_FD DONE_FD GRACE_S [ALSO] -- CMD...

    Fork a watchdog into its own session, then exec CMD as the group's leader. On EOF on ALIVE_FD, when the caller
    died or stop_server released it, the watchdog stops the group and exits, closing DONE_FD. If the caller died,
    it also kills ALSO, "PID:START,...": other processes the caller started, such as a local Ray's agents."""

    def say(text: str) -> None:
        with suppress(OSError):
            os.write(2, f"[server_watchdog] {text}\n".encode())

    def watch(pgid: int, alive_fd: int, leader_fd: int | None, grace_s: float, also: list[str]) -> None:
        watching_leader, released, partial = leader_fd is not None, False, b""
        while True:
            # Block on the leader's pidfd while it runs; after that its engines may live on, so poll each second.
            ready, _, _ = select.select(
                [alive_fd] + ([leader_fd] if watching_leader else []), [], [], None if watching_leader or also else 1.0
            )
            if alive_fd in ready:
                data = b""
                with suppress(OSError):
                    data = os.read(alive_fd, 4096)
                # Server.also_stop writes "aPID:START,...\n", a line each, which may span reads: keep a line's
                # start until its end comes. One cut short by the caller's death is dropped.
                *lines, partial = (partial + data).split(b"\n")
                for line in lines:
                    also += line[1:].decode().split(",") if line.startswith(b"a") else []
                released = released or b"r" in data  # stop_server writes "r" before it closes the pipe
                if not data:  # EOF: the caller is gone, or stop_server released us
                    if group_members(pgid):
                        say(f"the process that started the vLLM server is gone: stopping its process group {pgid}")
                        if left := stop_group(pgid, grace_s):
                            say(f"processes {left} of group {pgid} survived SIGKILL")
                    if also and not released:  # the caller died: stop what else it started
                        say(f"stopping {len(also)} other processes the caller started")
                        for pid, start in (entry.split(":") for entry in also):
                            if start_time(int(pid)) == start:  # not a reused PID
                                with suppress(ProcessLookupError):
                                    os.kill(int(pid), signal.SIGKILL)
                    return
            watching_leader = watching_leader and leader_fd not in ready
            # An empty group ends the watch, except with ALSO: then only the caller's release or death does.
            if not watching_leader and not also and not group_members(pgid):
                return

    alive_fd, done_fd, grace_s, *rest = sys.argv[2:]
    also = rest.pop(0).split(",") if rest and rest[0] != "--" else []
    if len(rest) < 2 or rest[0] != "--":
        sys.exit("usage: server_watchdog ALIVE_FD DONE_FD GRACE_S [PID:START,...] -- CMD [ARGS...]")
    alive_fd, done_fd, cmd, leader = int(alive_fd), int(done_fd), rest[1:], os.getpid()
    try:
        leader_fd = os.pidfd_open(leader)  # readable once the server exits; needs Linux 5.3+
    except (AttributeError, OSError):
        leader_fd = None
    child = os.fork()
    if child == 0:
        # Fork twice, into a new session: out of the server's group, and not a child the server would never reap.
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_IGN)
            os.dup2(fd := os.open(os.devnull, os.O_RDONLY), 0)
            os.close(fd)
            watch(leader, alive_fd, leader_fd, float(grace_s), also)
        except BaseException as e:  # noqa: BLE001 - report any failure in the server's log
            say(f"failed: {e!r}")
            os._exit(1)
        os._exit(0)  # closes done_fd, so the caller sees the watchdog gone
    # This process: once the watchdog has left the group, close the pipes and become the server.
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


def first_error(server: Server) -> str | None:
    """Return the log's first line that names an error, or None; vLLM's INFO, WARNING and DEBUG lines are skipped.
    A failed start often ends with "Engine core initialization failed. See root cause above": this is that cause."""
    try:
        lines = server.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    notice = re.compile(r"\b(INFO|WARNING|DEBUG) \d\d-\d\d ")  # vLLM's log level and date
    return next((line.strip() for line in lines if re.search(r"Error: ", line) and not notice.search(line)), None)


def start_failure(server: Server, code: int) -> str:
    """Say that the server exited with `code` while starting: its first error, and the last lines of its log."""
    tail, cause = log_tail(server), first_error(server)
    said = [f"vLLM server exited with code {code} during start"]
    if cause and cause not in tail:
        said.append(f"the first error in its log: {cause}")
    if cause and "out of memory" in cause.lower():
        said.append("vLLM ran out of GPU memory while starting, beside what the trainer ranks hold on the same GPUs")
    return "; ".join([*said, f"last lines of {server.log_path}:\n{tail}"])


START_MILESTONES = (  # log lines that mark a starting server's progress, used only to print it
    ("Initializing a V1 LLM engine", "engines starting"),
    ("Model loading took", "model built"),
    ("Starting torch.compile", "torch.compile ..."),
    ("torch.compile took", "torch.compile done"),
    ("Capturing CUDA", "capturing CUDA graphs ..."),
    ("Available KV cache memory", "memory profiled, KV cache sized"),
    ("init engine (profile, create kv cache, warmup model) took", "engines ready"),
    ("Starting vLLM server on", "API server listening"),
)


def print_progress(server: Server) -> None:
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return
    for needle, label in START_MILESTONES:
        if label not in server.milestones_shown and needle in text:
            server.milestones_shown.add(label)
            print(f"[server] {time.monotonic() - server.started_at:5.0f} s: {label}", flush=True)


def wait_until_healthy(server: Server, timeout_s: float = 900, poll_s: float = 1.0, also_check=None) -> float:
    """Wait until GET /health answers, printing progress; return seconds since start, or raise ServerError."""
    deadline = time.monotonic() + timeout_s
    while True:
        print_progress(server)
        if (code := server.proc.poll()) is not None:
            raise ServerError(start_failure(server, code))
        if also_check:  # after our own server's exit check, which names the cause for sure
            also_check()
        if health(server.socket_path):
            print_progress(server)  # milestones logged since this poll began
            return time.monotonic() - server.started_at
        if time.monotonic() > deadline:
            raise ServerError(
                f"vLLM server not healthy after {timeout_s:.0f}s; last lines of {server.log_path}:\n{log_tail(server)}"
            )
        time.sleep(poll_s)


def stop_server(server: Server, grace_s: float = 20.0) -> None:
    if left := stop_group(server.pgid, grace_s):
        raise ServerError(f"processes {left} of the vLLM server survived SIGKILL")
    with suppress(subprocess.TimeoutExpired):
        server.proc.wait(timeout=10)  # reap the leader, so no zombie is left
    _release_watchdog(server)
    forget_client(server.socket_path, every_thread=True)


@contextmanager
def serving(serve_args: Sequence[str] | None, **start_kwargs):
    """Yield start_server's server, still starting, and stop it on the way out; call wait_until_healthy inside."""
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
            except ServerError as e:  # print it, and let the error that brought us here propagate
                print(f"[shutdown] {e}", flush=True)


@contextmanager
def vllm_server(serve_args: Sequence[str], log_path: str | os.PathLike, timeout_s: float = 1200, **start_kwargs):
    """Serve `vllm serve <serve_args>` on a socket in a private directory of its own; yield the socket's path once
    healthy; stop it and remove the directory on the way out. Under torch.distributed every rank calls it at
    once: rank 0 serves, and every rank gets the path. A process without a process group serves itself."""
    serves = not dist.is_initialized() or dist.get_rank() == 0
    with tempfile.TemporaryDirectory(prefix="vllm-") if serves else nullcontext() as folder:  # 0700, yours alone
        socket_path = os.path.join(folder, "vllm.sock") if serves else None
        with (
            serving(serve_args, socket_path=socket_path, log_path=log_path, **start_kwargs)
            if serves
            else nullcontext() as server
        ):
            yield on_rank_zero(_healthy_socket, server, timeout_s)


def _healthy_socket(server: Server, timeout_s: float) -> str:
    server.healthy_after_s = wait_until_healthy(server, timeout_s)
    return server.socket_path


@contextmanager
def signals_ignored():
    """Ignore Ctrl-C, SIGTERM and SIGHUP, so a second one cannot cut a cleanup short and leave processes behind."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = [signal.signal(sig, signal.SIG_IGN) for sig in sigs]
    try:
        yield
    finally:
        for sig, handler in zip(sigs, previous, strict=True):
            signal.signal(sig, handler)


# ---- HTTP routes: one small function each. `sock` is the server's socket path ----
# The routes go through the standard library's HTTP client, 0.3-0.5 ms a call faster than httpx on a CPU vLLM
# server, and a sync makes three in a row. The OpenAI client, for completions, brings httpx.
class _Connection(http.client.HTTPConnection):
    """HTTP/1.1 over the server's Unix socket, kept open between calls; `answered_at`: its last answer's time."""

    def __init__(self, sock: str) -> None:
        super().__init__("localhost")
        self.socket_path, self.answered_at = sock, time.monotonic()

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


# Kept open, as a round's calls are milliseconds apart; per thread, so that a failed one can be closed at once.
_connections: dict[tuple[int, int, str], _Connection] = {}
_openai_clients: dict[tuple[int, int, str], Any] = {}
_clients_lock = threading.Lock()  # a thread's first call adds to these while another thread may forget its own


def _idle_limit_s() -> float:
    """Half the server's keep-alive: a connection idle for longer may be closing at the server's end."""
    return float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5")) / 2


def _connection(sock: str) -> _Connection:
    key = (os.getpid(), threading.get_ident(), sock)
    if (conn := _connections.get(key)) is None:
        with _clients_lock:
            conn = _connections[key] = _Connection(sock)
    elif time.monotonic() - conn.answered_at > _idle_limit_s():
        conn.close()  # the next request opens another
    return conn


def forget_client(sock: str, every_thread: bool = False) -> None:
    """Close this thread's connections to `sock`, or every thread's: after a failure, or when done with the server."""
    with _clients_lock:
        keys = [
            (table, key)
            for table in (_connections, _openai_clients)
            for key in table
            if key[0] == os.getpid() and key[2] == sock and (every_thread or key[1] == threading.get_ident())
        ]
        gone = [table.pop(key) for table, key in keys]
    for client in gone:
        client.close()


def request(
    sock: str, method: str, route: str, timeout: float = SERVER_CALL_TIMEOUT_S, params=None, body: Any = None
) -> Any:
    """Call `route` with query `params` (a dict or pairs) and a JSON `body`, and return its JSON; raise ServerError."""
    url = f"{route}?{urllib.parse.urlencode(params)}" if params else route
    conn = _connection(sock)
    conn.timeout = timeout
    if conn.sock is not None:
        conn.sock.settimeout(timeout)
    data = None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, url, data, {"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        reply = resp.read()
    except (OSError, http.client.HTTPException) as e:
        forget_client(sock)
        raise ServerError(f"{method} {route} failed: {e!r}") from e
    if resp.status != 200:
        forget_client(sock)  # vLLM may reset the connection after an error reply: the next call opens another
        raise ServerError(f"{method} {route} -> HTTP {resp.status}: {reply.decode(errors='replace')[:2000]}")
    conn.answered_at = time.monotonic()
    return json.loads(reply) if reply else None


def health(sock: str) -> bool:
    try:
        request(sock, "GET", "/health", timeout=5)  # through request, which drops a failed connection
    except ServerError:
        return False
    return True


def sleep(sock: str, level: int) -> dict:
    """POST /sleep: level 0 pauses scheduling, 1 also offloads the weights to CPU, 2 discards them."""
    return request(sock, "POST", "/sleep", params={"level": level})


def release_kv_cache(sock: str) -> dict:
    """POST /release_kv_cache_memory after a level-0 sleep: free the KV cache and reset the prefix cache."""
    return request(sock, "POST", "/release_kv_cache_memory")


def sleep_for_sync(sock: str, level: int, free_kv_cache: bool = True) -> bool:
    """Pause serving for a sync and return whether the KV cache was freed; level 0 frees it if `free_kv_cache`.

    Else, at level 0, the prefix cache, computed with the old weights, is reset beside the sync, which saves a
    round trip; wake_to_serve waits for the reset before vLLM serves again."""
    sleep(sock, level)
    if level == 0 and free_kv_cache:
        release_kv_cache(sock)
    elif level == 0:
        _resetting[sock] = _beside_the_sync.submit(reset_prefix_cache, sock)
    return level > 0 or free_kv_cache


def reset_prefix_cache(sock: str, tries: int = 5, wait_s: float = 0.05) -> None:
    """POST /reset_prefix_cache until vLLM says it is done, or raise ServerError. vLLM answers {"success": false}
    while blocks are still held, briefly after a pause: try again after `wait_s`, twice as long each time (0.75 s
    in all, beside the send). A vLLM that answers nothing is taken at its word."""
    for attempt in range(tries):
        time.sleep(wait_s * 2 ** (attempt - 1) if attempt else 0)
        if (reply := request(sock, "POST", "/reset_prefix_cache")) is None or reply.get("success", True):
            return
    raise ServerError(
        f"POST /reset_prefix_cache answered {json.dumps(reply)} {tries} times: the prefix cache, computed "
        "from the old weights, could not be reset; vLLM is left asleep rather than serve from it"
    )


_beside_the_sync = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefix-cache-reset")
_resetting: dict[str, Future] = {}  # by socket: the prefix cache's reset, until wake_to_serve waits for it


def wake_weights(sock: str, level: int) -> None:
    if level > 0:
        wake_up(sock, ["weights"])


def wake_up(sock: str, tags: Iterable[str] | None = None) -> dict:
    """POST /wake_up?tags=...: map the named memory pools back, or all of them if `tags` is None."""
    return request(sock, "POST", "/wake_up", params=[("tags", t) for t in tags] if tags else None)


def wake_to_serve(sock: str, kv_cache: bool = True) -> None:
    """Map the KV cache back if it was freed, resume scheduling, and raise unless the server is awake."""
    if (reset := _resetting.pop(sock, None)) is not None:
        reset.result()  # the prefix cache is empty before anything is served with the new weights
    try:
        state = wake_up(sock, ["kv_cache", "scheduling"] if kv_cache else ["scheduling"])
    except ServerError as e:
        raise ServerError(wake_failure(str(e), kv_cache)) from e
    if state["status"] != "awake":
        raise ServerError(f"server still asleep after the last wake_up: {state}")


def wake_failure(error: str, kv_cache: bool) -> str:
    if not (kv_cache and "out of memory" in error.lower()):
        return error
    return (
        "vLLM could not map its KV cache back: the GPU's memory it freed was taken meanwhile (by another process "
        f"on the GPU, or kept by the trainer); keep the KV cache through the sync, or make it smaller: {error}"
    )


def is_sleeping(sock: str) -> bool:
    return request(sock, "GET", "/is_sleeping")["is_sleeping"]


def openai_client(sock: str):
    """Return this thread's OpenAI client for the server, kept open as the routes' connections are."""
    import openai

    key = (os.getpid(), threading.get_ident(), sock)
    if (client := _openai_clients.get(key)) is None:  # skipping TLS setup and proxies
        transport = httpx.HTTPTransport(uds=sock, verify=False, limits=httpx.Limits(keepalive_expiry=_idle_limit_s()))
        http_client = httpx.Client(transport=transport, base_url="http://localhost", trust_env=False)
        client = openai.OpenAI(base_url="http://localhost/v1", api_key="-", max_retries=0, http_client=http_client)
        with _clients_lock:
            _openai_clients[key] = client
    return client


def collective_rpc(sock: str, method: str, *args: str, timeout: float = SERVER_CALL_TIMEOUT_S) -> list:
    """POST /collective_rpc: call `method` on every engine's workers and return the first DP engine's results."""
    body = {"method": method, "args": list(args), "timeout": timeout}
    out = request(sock, "POST", "/collective_rpc", timeout=timeout + 10, body=body)
    return out["results"] if out else []


# ---- Weight sync clients: what vLLM's IPC trainer engine calls on trainer rank 0 ----
class WeightSyncClient:
    """vLLM's weight routes over the server's socket, raising ServerError: the calls vLLM's IPC trainer engine
    makes on rank 0 (vLLM's structural VLLMWeightSyncClient), as vLLM's HTTPVLLMWeightSyncClient makes them."""

    def __init__(self, sock: str, timeout: float = SERVER_CALL_TIMEOUT_S) -> None:
        self.sock, self.timeout = sock, timeout

    def _post(self, route: str, body: dict | None = None) -> None:
        request(self.sock, "POST", route, timeout=self.timeout, body=body)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict | list) -> None:
        infos = update_info if isinstance(update_info, list) else [update_info]
        sent = [_handles_pickled(info) for info in infos]
        self._post("/update_weights", {"update_info": sent if isinstance(update_info, list) else sent[0]})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")


def _handles_pickled(update_info: dict) -> dict:
    """CUDA IPC handles are no JSON: the route takes them pickled and base64-encoded, as `ipc_handles_pickled`."""
    if update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    pickled = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return {**{k: v for k, v in update_info.items() if k != "ipc_handles"}, "ipc_handles_pickled": pickled}


class FailAfterSend:
    """Rank 0's client, raising a failure only after the send: the ranks meet at a barrier for every chunk."""

    def __init__(self, client) -> None:
        self.client, self._failure = client, None

    def start_weight_update(self) -> None:
        self._failure = None
        self._call(self.client.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        if self._failure is None:
            self._call(self.client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.client.finish_weight_update, weight_version)  # even after a failure: it closes the session

    def take_failure(self) -> ServerError | None:
        """Return the send's first failure, if any, and forget it."""
        failure, self._failure = self._failure, None
        return failure

    def raise_failure(self) -> None:
        if (failure := self.take_failure()) is not None:
            raise failure

    def __getattr__(self, name: str):  # other calls, such as init_weight_transfer_engine at setup, raise at once
        return getattr(self.client, name)

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except ServerError as e:
            self._failure = self._failure or e


# ---- Every trainer rank at once, on torch.distributed alone: a Ray actor's or torchrun's ----
_own_group: tuple | None = None  # (the default group, a gloo group of the same ranks made beside it)


def sync_group():
    """Return the group the sync's own small collectives run on, whatever the default group's backend: the default
    group, unless it can run them neither on the CPU nor on this rank's GPU (as init_process_group("cuda:gloo")
    on a machine without one); then a gloo group of the same ranks, made once. Every rank calls it at once."""
    global _own_group
    devices = {pair.split(":")[0] for pair in dist.get_backend_config().split(",")}
    if "cpu" in devices or ("cuda" in devices and torch.cuda.is_available()):
        return dist.group.WORLD
    if _own_group is None or _own_group[0] is not dist.group.WORLD:
        _own_group = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return _own_group[1]


def every_rank(value) -> list:
    """Return every rank's `value` in rank order; every rank calls it at once. Without a process group, [value]."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=sync_group())
    return gathered


def on_rank_zero(fn, *args, **kwargs):
    """Call fn(*args, **kwargs) on rank 0 once every rank is here; return its result, or raise, on every rank.

    For ranks without a driver, such as torchrun's, all calling it at once: rank 0 calls the server once, after
    what every rank did before (its step, or emptying PyTorch's cache), and no rank waits on a failed call."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn(*args, **kwargs)
    group, outcome = sync_group(), [None]
    dist.barrier(group=group)
    try:
        if dist.get_rank() == 0:
            outcome = [(True, fn(*args, **kwargs))]
    except Exception as e:
        outcome = [(False, e if isinstance(e, ServerError) else ServerError(f"rank 0: {type(e).__name__}: {e}"))]
        raise
    finally:
        dist.broadcast_object_list(outcome, src=0, group=group)
    returned, value = outcome[0] or (False, ServerError("rank 0 stopped before it called the server"))
    if not returned:
        raise value
    return value


def physical_gpu_id(index: int) -> str:
    """Return how `--device-ids` names this process's CUDA device `index`: its CUDA_VISIBLE_DEVICES entry (which
    start_server drops), or the index. Under `CUDA_VISIBLE_DEVICES=2,3 torchrun ...`, rank 0's cuda:0 is GPU 2."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible.split(",")[index].strip() if visible else str(index)


def rank_gpus() -> list[dict]:
    """Return each rank's current GPU in rank order, {"gpu_id": for `--device-ids`, "gpu_uuid": ...}; every rank
    calls it at once. A rank without a GPU has gpu_id None and gpu_uuid ""."""
    mine = {"gpu_id": None, "gpu_uuid": ""}
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        mine = {"gpu_id": physical_gpu_id(index), "gpu_uuid": str(torch.cuda.get_device_properties(index).uuid)}
    return every_rank(mine)


@contextmanager
def _cut_short_if_unanswered(sock: str | None, poll_s: float = 2.0):
    """Inside, cut short this process's calls to `sock` once GET /health fails twice in a row: vLLM's API server
    waits for good on a call to an engine that died."""
    done = threading.Event()

    def watch() -> None:
        misses = 0
        while not done.wait(poll_s):
            misses = 0 if health(sock) else misses + 1
            with _clients_lock:  # the other threads' connections; shutdown() ends a blocked read, unlike close()
                held = [c for k, c in _connections.items() if k[2] == sock and k[1] != threading.get_ident()]
            for conn in held if misses >= 2 else ():
                with suppress(OSError, AttributeError):  # (a connection not open has no socket)
                    conn.sock.shutdown(socket.SHUT_RDWR)
        forget_client(sock)  # this thread's own connection

    if sock is not None:
        threading.Thread(target=watch, name="send-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# ---- A trainer rank's half of the sync ----
def metadata_bytes(metadata) -> int:
    return sum(math.prod(m.shape) * m.dtype.itemsize for m in metadata)


def source_metadata(source) -> list:
    """Return a weight source's metadata: an attribute from vLLM 0.33 on, a method in vLLM 0.32's ModuleSource."""
    return source.metadata() if callable(source.metadata) else source.metadata


@dataclass
class WeightSender:
    """One trainer rank's side of the sync, built by weight_sender; several may share one source."""

    client: FailAfterSend
    engine: Any  # vLLM's IPC trainer engine
    in_place: Any  # sources.InPlace: tensors the engines copy from this rank's memory, not packed
    source: Any  # the WeightSource it sends: the packed part, then the tensors in place
    rank: int
    packed: bool
    packed_buffer_size_bytes: int
    retries: int = 0  # sends again from the start when the server failed one part way and still answers

    def send(self, empty_cache: bool = False) -> int:
        """Send every weight and return how many times it was sent again; every rank calls it at once.

        Rank 0's server calls raise only after the send, as the ranks meet for every chunk, and are cut short if
        the server stops answering. If it failed the send part way and still answers, every rank sends again, up
        to `retries` times. With `empty_cache`, every rank empties PyTorch's cache before any rank returns, so that
        vLLM can map back a KV cache it freed (wake_to_serve). A failed send raises one ServerError on every rank."""
        first = None
        for attempt in range(self.retries + 1):
            with _cut_short_if_unanswered(self.sock if self.rank == 0 else None):
                if self.in_place is not None:
                    self.in_place.gather()  # rank 0's client hands every rank's handles to the engines
                self.engine.send_weights()
            verdict = None
            if (failure := self.client.take_failure()) is not None:
                first = first or failure
                verdict = self._verdict(failure, first, attempt)
            if empty_cache and torch.cuda.is_available():
                torch.cuda.empty_cache()
            verdict = every_rank(verdict)[0]  # rank 0's, once every rank is through
            if verdict is None:
                return attempt
            if verdict != "retry":
                raise ServerError(verdict)
        raise AssertionError("unreachable: the last attempt's verdict is never a retry")

    @property
    def sock(self) -> str | None:
        return getattr(self.client.client, "sock", None)  # the server's socket, for a client that has one

    def _verdict(self, failure: ServerError, first: ServerError, attempt: int) -> str:
        """On rank 0: "retry", or why the send failed, for every rank to raise."""
        if attempt < self.retries and (self.sock is None or health(self.sock)):
            print(f"[send] {failure}\n[send] vLLM is still asleep: sending every weight again", end=" ")
            print(f"(retry {attempt + 1} of {self.retries})", flush=True)
            return "retry"
        if attempt < self.retries:
            detail = "not retried: the server does not answer"
        else:
            detail = f"{attempt + 1} tries" if attempt else "not retried"
        return f"the send failed part way ({detail}); vLLM holds a mix of old and new weights: {first}"


def weight_sender(
    rank: int, client, source, packed: bool = True, packed_buffer_size_bytes: int = 4 * 1024**3, retries: int = 0
) -> WeightSender:
    """Build this rank's vLLM IPC trainer engine to send `source`; rank 0 calls `client` for each chunk.

    Every rank calls it at once, with the same kind of source. `retries`: how often a send the server failed part
    way is sent again (the direct loader's; vLLM's own loader leaves a failed reload half done)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    in_place = getattr(source, "in_place", None)
    if in_place is not None and getattr(client, "in_place", None) is not in_place:
        in_place = None  # this client cannot hand them to the engines, e.g. vLLM's routes: pack them
    packed_part = in_place.packed_part(source) if in_place else source  # all but the tensors in place
    packs, told = metadata_bytes(source_metadata(packed_part)), getattr(client, "packed_bytes", None)
    if told is not None and told != packs:
        raise ValueError(
            f"the direct loader's client expects {told} packed bytes a send and this source packs "
            f"{packs}: build the client for this source (sync_client)"
        )
    client = FailAfterSend(client)
    # A buffer no larger than what is packed: with everything in place, nothing is.
    buffer = min(packed_buffer_size_bytes, max(packs, 1 << 20)) if packed else packed_buffer_size_bytes
    engine = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(rank=rank, packed=packed, packed_buffer_size_bytes=buffer), client=client, source=packed_part
    )
    return WeightSender(client, engine, in_place, source, rank, packed, packed_buffer_size_bytes, retries)
