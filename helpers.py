"""The vLLM server for rlhf_ipc_fsdp_ep.py: its life cycle, and one small
function per HTTP route.

The server listens on a Unix socket in a directory only its user can enter,
never on a TCP port: its dev routes (/sleep, /collective_rpc, the weight
routes) and the pickled IPC handles they take would let any client that
reaches them run code in the server. Usable on its own, without Ray or a GPU:

    server = start_server(["Qwen/Qwen3-30B-A3B", "--load-format", "dummy"],
                          socket_path=private_dir / "vllm.sock")
    wait_until_healthy(server, timeout_s=600)
    print(completions(server.socket_path, "Qwen/Qwen3-30B-A3B", ["Hello"], max_tokens=8))
    stop_server(server)

Any HTTP client reaches it through the socket, e.g.
`curl --unix-socket <socket> http://localhost/health`, or
`openai.OpenAI(base_url="http://localhost/v1", api_key="-",
http_client=httpx.Client(transport=httpx.HTTPTransport(uds=<socket>)))`.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from server_watchdog import group_members, proc_stat, start_time  # (shared with the watchdog)

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
    process group, with its output in `log_path`.

    The socket's directory must be private to this user (mode 0700, as
    tempfile.mkdtemp makes it): other users cannot connect then. vLLM's
    internal ZMQ sockets go there too (VLLM_RPC_BASE_PATH). `env` is
    merged over this process's environment and SERVER_ENV. Ray's GPU mask is
    dropped (a caller inside Ray would otherwise hand the server one GPU):
    pass `--device-ids` to choose GPUs instead.

    The server cannot outlive this process: a watchdog (server_watchdog.py)
    stops its whole group once this process is gone, however it ended, and
    then also the processes in `also_stop` (from `descendants`).
    """
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
    full_env = {**os.environ, **SERVER_ENV, **(env or {})}
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
    """Popen(cmd) as the leader of a new process group, through
    server_watchdog.py, which forks the watchdog off (outside the group) and
    then execs `cmd`: the Popen is the server itself. The group holds the
    server's API servers, engine cores and DP coordinator, so stop_server and
    the watchdog can signal every one of them, not only the parent.

    Two pipes: only this process holds the write end of `alive`, so the
    watchdog reads EOF when this process is gone; only the watchdog holds the
    write end of `done`, so stop_server reads EOF when the watchdog is gone."""
    alive_r, alive_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _WATCHDOG_SCRIPT, str(alive_r), str(done_w), str(_WATCHDOG_GRACE_S),
             *([",".join(also_stop)] if also_stop else []), "--", *cmd],
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


def descendants(pid: int, started_from: str | None = None) -> list[str]:
    """"PID:START" of the live descendants of process `pid` (Linux /proc),
    for start_server's `also_stop`. With `started_from` (a directory), only
    the children whose command line runs something in it, and all theirs:
    e.g. the processes of a local Ray cluster `pid` started, and no others."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if (stat := proc_stat(entry)) is not None:
            children.setdefault(int(stat[1]), []).append(int(entry))
    todo = [c for c in children.get(pid, []) if started_from is None or started_from.encode() in cmdline(c)]
    found, seen = [], set()
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        if (start := start_time(child)) is not None:
            found.append(f"{child}:{start}")
        todo += children.get(child, [])
    return found


def cmdline(pid: int) -> bytes:
    """/proc/PID/cmdline (arguments NUL-separated), b"" if the process is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


# The watchdog's grace between SIGTERM and SIGKILL once the starting process is gone.
_WATCHDOG_GRACE_S = 10.0
_WATCHDOG_SCRIPT = str(Path(__file__).resolve().with_name("server_watchdog.py"))


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
def hangups_unwind():
    """SIGTERM and SIGHUP (a scheduler's stop, a closed terminal) end the
    program the way Ctrl-C does: by an exception that runs every `finally`
    (and so stops the server) on the way out; out of this block it becomes
    SystemExit(128 + signal). The exception is a KeyboardInterrupt (Hangup),
    because a blocking Ray call (ray.wait, ray.get) gives way to that one
    alone: it turns any other exception raised in a signal handler into an
    exit with code 1."""
    _hangups_received.clear()
    previous = unwind_on_hangups()
    try:
        yield
    except KeyboardInterrupt:  # (Ray raises its own KeyboardInterrupt in place of ours)
        if _hangups_received:
            raise SystemExit(128 + _hangups_received[0]) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Hangup(KeyboardInterrupt):
    """SIGTERM or SIGHUP received inside hangups_unwind."""


_hangups_received: list[int] = []


def unwind_on_hangups() -> dict:
    """hangups_unwind's handlers, (re)installed; returns the ones they replace.
    Again after a library that installs its own: ray.init() puts in Ray's,
    under which a SIGTERM during a blocking Ray call aborts the process, or
    ends it with code 1, midway through the cleanup."""
    return {sig: signal.signal(sig, _unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _unwind(signum: int, _frame) -> None:
    _hangups_received.append(signum)
    raise Hangup(f"signal {signum}")


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


def _client(sock: str, timeout: float) -> httpx.Client:
    # Plain HTTP over a local socket: no TLS context to build (loading the CA
    # certificates costs ~30 ms per client, 34 times a sync) and no proxy.
    transport = httpx.HTTPTransport(uds=sock, verify=False)
    return httpx.Client(transport=transport, base_url="http://localhost", timeout=timeout, trust_env=False)


def _request(sock: str, method: str, route: str, timeout: float = SERVER_CALL_TIMEOUT_S, **kwargs) -> Any:
    """Call a route; return its JSON; raise ServerError with the server's own
    error text."""
    try:
        with _client(sock, timeout) as client:
            resp = client.request(method, route, **kwargs)
    except httpx.HTTPError as e:
        raise ServerError(f"{method} {route} failed: {e!r}") from e
    if resp.status_code != 200:
        raise ServerError(f"{method} {route} -> HTTP {resp.status_code}: {resp.text[:2000]}")
    return resp.json() if resp.content else None


def health(sock: str) -> bool:
    try:
        with _client(sock, timeout=5) as client:
            return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def sleep(sock: str, level: int) -> dict:
    """POST /sleep: level 0 only pauses scheduling; level 1 also offloads the
    weights to CPU, level 2 discards them; both free the KV cache."""
    return _request(sock, "POST", "/sleep", params={"level": level})


def release_kv_cache(sock: str) -> dict:
    """POST /release_kv_cache_memory: after /sleep?level=0, give the KV
    cache's GPU memory back (the weights stay); /wake_up?tags=kv_cache maps it
    again. Resets the prefix cache, whose entries the old weights computed."""
    return _request(sock, "POST", "/release_kv_cache_memory")


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
    _request(sock, "POST", "/reset_prefix_cache")


def wake_weights(sock: str, level: int) -> None:
    """POST /wake_up?tags=weights: map the weights back before the send,
    unless level 0 kept them mapped."""
    if level > 0:
        wake_up(sock, ["weights"])


def wake_up(sock: str, tags: Iterable[str] | None = None) -> dict:
    """POST /wake_up?tags=...: map back the named memory pools (all if None)."""
    params = [("tags", t) for t in tags] if tags else None
    return _request(sock, "POST", "/wake_up", params=params)


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
    return _request(sock, "GET", "/is_sleeping")["is_sleeping"]


def weight_checker(sock: str, action: str, baseline: dict | None = None) -> dict:
    """POST /weight_checker: 'reset' zeroes every parameter, 'checksum' returns
    {key: sha256}, 'compare' checks against a baseline."""
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = baseline
    return _request(sock, "POST", "/weight_checker", json=body)


@dataclass
class Completion:
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]


def _completions(sock: str, body: dict, dp_rank: int | None) -> dict:
    """POST /v1/completions; `dp_rank` pins it to one DP engine."""
    headers = {"X-data-parallel-rank": str(dp_rank)} if dp_rank is not None else None
    return _request(sock, "POST", "/v1/completions", headers=headers, json=body)


def completions(
    sock: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    temperature: float = 0.0,
    dp_rank: int | None = None,
) -> list[Completion]:
    """One completion per prompt (greedy by default), with the prompt's and
    the output's token ids."""
    body = {
        "model": model,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "return_token_ids": True,
    }
    by_index = {c["index"]: c for c in _completions(sock, body, dp_rank)["choices"]}
    return [
        Completion(c["text"], list(c["prompt_token_ids"]), list(c["token_ids"]))
        for c in (by_index[i] for i in range(len(prompts)))
    ]


def prompt_logprobs(sock: str, model: str, token_ids: list[int], dp_rank: int | None = None) -> list[float]:
    """vLLM's log-probability of each prompt token given the ones before it
    (len(token_ids) - 1 values). `dp_rank` pins the request to one DP engine."""
    body = {"model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    per_position = _completions(sock, body, dp_rank)["choices"][0]["prompt_logprobs"]
    # Position 0 has no context (None); each later entry maps token id -> info
    # and always holds the prompt's own token.
    return [entry[str(tok)]["logprob"] for tok, entry in zip(token_ids[1:], per_position[1:], strict=True)]


def collective_rpc(sock: str, method: str, *args: str, timeout: float = SERVER_CALL_TIMEOUT_S) -> list:
    """POST /collective_rpc: call `method` on the worker of every engine
    (string arguments only). Returns the first DP engine's results; an error
    on any engine fails the call."""
    body = {"method": method, "args": list(args), "timeout": timeout}
    out = _request(sock, "POST", "/collective_rpc", timeout=timeout + 10, json=body)
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
            _request(sock, "POST", f"/{path}", timeout=self.timeout, json=json)

    return WeightSyncClient(sock, timeout=SERVER_CALL_TIMEOUT_S)


class DirectLoadClient:
    """The same calls as vLLM's HTTPVLLMWeightSyncClient, sent to the server's
    direct loader (direct_load.py) through /collective_rpc instead of vLLM's
    weight routes. `expert_blocks` ({name: shape} of the expert blocks each
    rank will send) is checked against every engine when vLLM's IPC engine is
    built, so a layout the server cannot take fails before any send."""

    def __init__(self, sock: str, trainer_gpu_uuids: list[str], expert_blocks: dict[str, tuple]) -> None:
        if len(set(trainer_gpu_uuids)) != len(trainer_gpu_uuids):
            raise ValueError(f"two trainer ranks on one GPU ({trainer_gpu_uuids}): the direct loader "
                             "needs one rank per GPU")  # fmt: skip
        self.sock = sock
        self.trainer_gpu_uuids = list(trainer_gpu_uuids)
        self.expert_blocks = {name: list(shape) for name, shape in expert_blocks.items()}

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        if not init_info.get("packed"):
            raise ValueError("the direct loader reads packed IPC buffers: use packed=True")
        expected = {"blocks": self.expert_blocks, "dtype": "bfloat16", "trainer_gpu_uuids": self.trainer_gpu_uuids}
        collective_rpc(self.sock, "direct_load_check", json.dumps(expected))

    def start_weight_update(self) -> None:
        collective_rpc(self.sock, "direct_load_start")

    def update_weights(self, update_info: dict) -> dict:
        """One chunk; returns what the first DP engine reports of it."""
        import base64
        import pickle

        update = {**update_info, "trainer_gpu_uuids": self.trainer_gpu_uuids}
        return collective_rpc(self.sock, "direct_load_chunk", base64.b64encode(pickle.dumps(update)).decode())[0]

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        collective_rpc(self.sock, "direct_load_finish")

    def shutdown_weight_transfer_engine(self) -> None:
        pass


class FailAfterSend:
    """Rank 0's weight sync client, made safe to retry. In a send, vLLM's IPC
    trainer engine has every rank all-gather IPC handles and meet at a barrier
    for each chunk, and only rank 0 calls the client: if a call raised there,
    rank 0 would leave the send while the others wait at the next barrier (for
    the 10-minute collective timeout), and no retry could start. So after a
    failed call the send's remaining updates are skipped, `finish_weight_update`
    is still called (the direct loader's finish closes its session; its own
    failure is ignored), and `raise_failure()` raises the first error once the
    send is over. Only the direct loader's sends are retried (send_all)."""

    def __init__(self, client) -> None:
        self._client, self._failure = client, None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._client.init_weight_transfer_engine(init_info)  # at setup, not in a send: raise now

    def start_weight_update(self) -> None:
        self._failure = None
        self._call(self._client.start_weight_update)

    def update_weights(self, update_info: dict) -> None:
        if self._failure is None:
            self._call(self._client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self._client.finish_weight_update, weight_version)

    def raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def __getattr__(self, name: str):  # anything else vLLM may call
        return getattr(self._client, name)

    def _call(self, method, *args) -> None:
        try:
            method(*args)
        except ServerError as e:
            self._failure = self._failure or e

