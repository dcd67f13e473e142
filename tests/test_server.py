# SPDX-License-Identifier: Apache-2.0
"""The vLLM server's life cycle and routes, on a real vLLM server on CPU."""

import errno
import json
import os
import signal
import socket
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import helpers
from conftest import (
    CPU_LAUNCHER,
    SERVED_NAME,
    as_another_user,
    cpu_serve_args,
    healthy_or_stopped,
    listening_tcp,
    metrics_text,
    private_socket_path,
    socket_inodes,
    start_cpu_server,
)
from proof import logprob_gate
from weight_sync import generation


def test_health_and_sleep_state(cpu_server):
    assert helpers.health(cpu_server.socket_path)
    assert helpers.is_sleeping(cpu_server.socket_path) is False


def test_the_kv_cache_holds_the_tokens_asked_for_not_the_whole_share(cpu_server):
    """serve_args(kv_cache_tokens=1024) gives vLLM a cache of at least that
    many tokens (in whole blocks: 128 tokens each on CPU), not the 1 GiB of
    ~2 M tokens this server's memory would hold."""
    import re

    tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", cpu_server.log_path.read_text())[1].replace(",", ""))
    assert 1024 <= tokens <= 1024 * 128 // helpers.KV_BLOCK_TOKENS, tokens


def test_weight_sync_client_quotes_the_servers_errors(cpu_server):
    """helpers.WeightSyncClient: vLLM's weight routes, as vLLM's IPC trainer engine calls them on rank 0, through
    this project's own HTTP calls over the socket (no private method of vLLM's client overridden)."""
    import base64
    import pickle

    client = helpers.WeightSyncClient(cpu_server.socket_path)
    client.init_weight_transfer_engine({"packed": True})
    client.start_weight_update()
    try:
        # A second start while one is active is refused; the error must carry
        # the server's own explanation, not just "HTTP 500".
        with pytest.raises(helpers.ServerError, match="(?i)active"):
            client.start_weight_update()
    finally:
        client.finish_weight_update()
    client.start_weight_update()  # finishing made a new update possible
    # A chunk's CUDA IPC handles travel pickled, as the route takes them (ipc_handles_pickled); handles the server
    # cannot unpickle fail the route itself. (Handles it can unpickle reach the worker, which needs CUDA to read
    # them: on CPU that ends this shared server's engine, so the GPU runs show that half.)
    chunk = {"names": ["x"], "dtype_names": ["bfloat16"], "shapes": [[0]], "tensor_sizes": [0]}
    sent = helpers._handles_pickled({**chunk, "ipc_handles": {"GPU-x": (1, 2)}})
    assert pickle.loads(base64.b64decode(sent.pop("ipc_handles_pickled"))) == {"GPU-x": (1, 2)} and sent == chunk
    with pytest.raises(helpers.ServerError, match="HTTP") as refused:
        client._post("/update_weights", {"update_info": {**chunk, "ipc_handles_pickled": "x"}})
    assert "Torch not compiled" not in str(refused.value), str(refused.value)
    client.start_weight_update()  # (the refusal ended the update) and the server serves on
    client.finish_weight_update()


def test_completions_are_greedy_and_carry_token_ids(cpu_server, tiny_checkpoint):
    from transformers import AutoTokenizer

    prompts = ["The capital of France is", "Hello, my name is"]
    first = generation.completions(cpu_server.socket_path, SERVED_NAME, prompts, max_tokens=6)
    second = generation.completions(cpu_server.socket_path, SERVED_NAME, prompts, max_tokens=6)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    for prompt, c in zip(prompts, first, strict=True):
        assert c.prompt_token_ids == tok(prompt).input_ids
        assert len(c.token_ids) == 6


def test_prompt_logprobs_one_per_token_after_the_first(cpu_server):
    ids = [5, 17, 99, 300, 42, 7]
    lps = logprob_gate.prompt_logprobs(cpu_server.socket_path, SERVED_NAME, ids)
    assert len(lps) == len(ids) - 1
    assert all(lp <= 0 for lp in lps)
    assert lps == logprob_gate.prompt_logprobs(cpu_server.socket_path, SERVED_NAME, ids, dp_rank=0)
    # The header really picks an engine: this server has one, so DP rank 1 is refused.
    with pytest.raises(helpers.ServerError, match=r"HTTP 400.*data_parallel_rank 1 is out of range"):
        logprob_gate.prompt_logprobs(cpu_server.socket_path, SERVED_NAME, ids, dp_rank=1)


def test_the_sleep_and_wake_sequence_of_a_sync(cpu_server):
    """What a round asks of the server around the send: asleep after /sleep
    and after waking only the weights; awake after the KV cache and the
    scheduler. (The CPU server accepts the calls; freeing memory needs a GPU.)"""
    sock = cpu_server.socket_path
    assert helpers.sleep(sock, 2) == {"status": "sleeping", "level": 2}
    assert helpers.is_sleeping(sock)
    assert helpers.wake_up(sock, ["weights"])["status"] == "sleeping"
    assert helpers.is_sleeping(sock)
    helpers.wake_to_serve(sock)
    assert not helpers.is_sleeping(sock)
    assert len(generation.completions(sock, SERVED_NAME, ["Hello"], max_tokens=2)[0].token_ids) == 2


def test_the_sleep_and_wake_sequence_of_a_sync_that_keeps_the_weights(cpu_server):
    """--sleep-level 0: paused, then the KV cache's release reaches every
    engine (the CPU build cannot release it, and says so: the GPU runs cover
    the release itself), weights never woken, then serving again."""
    sock = cpu_server.socket_path
    assert helpers.sleep(sock, 0) == {"status": "sleeping", "level": 0}
    assert helpers.is_sleeping(sock)
    with pytest.raises(helpers.ServerError, match="Selective discard is not supported on CPU"):
        helpers.release_kv_cache(sock)
    helpers.wake_weights(sock, 0)  # nothing to wake: a wake_up?tags=weights here would leave it asleep
    assert helpers.is_sleeping(sock)
    helpers.wake_to_serve(sock)
    assert not helpers.is_sleeping(sock)
    assert len(generation.completions(sock, SERVED_NAME, ["Hello"], max_tokens=2)[0].token_ids) == 2


def test_a_sync_without_a_step_keeps_the_kv_cache_and_forgets_the_cached_prompts(cpu_server):
    """Without a training step to make room for, a sync only pauses vLLM
    (no KV cache freed and mapped back, whatever its size) and resets its
    prefix cache: the old weights computed those entries, so the same prompt
    after the sync must not be served from them."""
    sock = cpu_server.socket_path
    prompt = ["Reinforcement learning moves weights into a server after every step. " * 12]
    generation.completions(sock, SERVED_NAME, prompt, max_tokens=1)
    hits = prefix_cache_hits(sock)
    generation.completions(sock, SERVED_NAME, prompt, max_tokens=1)
    assert prefix_cache_hits(sock) > hits  # the prompt's blocks were cached: the check below can fail
    assert helpers.sleep_for_sync(sock, 0, free_kv_cache=False) is False  # nothing for wake_to_serve to map back
    helpers.wake_weights(sock, 0)
    helpers.wake_to_serve(sock, kv_cache=False)
    assert not helpers.is_sleeping(sock)
    hits = prefix_cache_hits(sock)
    generation.completions(sock, SERVED_NAME, prompt, max_tokens=1)
    assert prefix_cache_hits(sock) == hits


def test_a_kv_cache_that_cannot_be_mapped_back_is_explained():
    """The error vLLM 0.33 gave on one H200 when the memory of the KV cache it
    had freed was taken meanwhile (a soak's round 83, other servers starting)."""
    seen = (
        'POST /wake_up -> HTTP 500: {"error":{"message":"Call to wake_up method failed: CUDA Error: out of '
        'memory at <path>:163","type":"InternalServerError","param":null,"code":500}}'
    )
    assert helpers.wake_failure(seen, kv_cache=True) == (
        "vLLM could not map its KV cache back: the GPU's memory it freed was taken meanwhile (by another process "
        "on the GPU, or kept by the trainer); keep the KV cache through the sync, or make it smaller: " + seen
    )
    assert helpers.wake_failure(seen, kv_cache=False) == seen  # the cache was kept: not that
    assert helpers.wake_failure("POST /wake_up -> HTTP 500: something else", kv_cache=True).endswith("something else")


def prefix_cache_hits(sock) -> float:
    """vLLM's prefix-cache hit counter (tokens), from GET /metrics."""
    text = metrics_text(sock)
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def test_only_this_user_can_reach_the_server(cpu_server):
    """The dev routes and pickled IPC handles run code in the server: it must
    not listen on any TCP port, and its socket must refuse other users."""
    sock = cpu_server.socket_path
    folder = os.stat(os.path.dirname(sock))
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    assert stat.S_ISSOCK(os.stat(sock).st_mode)
    ports = {port for _, port in listening_tcp(helpers.group_members(cpu_server.pgid))}
    # The engines' own sockets (gloo, ZMQ) may listen on loopback: none may speak HTTP. (All asked at
    # once: each that does not answer costs its whole timeout.)
    with ThreadPoolExecutor(max(1, len(ports))) as pool:
        answers = dict(zip(ports, pool.map(_answers_http, ports)))
    assert not any(answers.values()), answers
    assert _connect_as_another_user(sock) == errno.EACCES
    # vLLM's own ZMQ sockets between its processes are in the same private directory.
    bound = _unix_sockets_of(helpers.group_members(cpu_server.pgid))
    assert bound and all(os.path.dirname(path) == os.path.dirname(sock) for path in bound), bound
    assert {_connect_as_another_user(path) for path in bound} == {errno.EACCES}


def _answers_http(port) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.settimeout(2)
        conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        try:
            return conn.recv(64).startswith(b"HTTP/")
        except (TimeoutError, ConnectionResetError):
            return False


def _unix_sockets_of(pids):
    """Paths of the Unix sockets (not abstract ones) that `pids` have open."""
    inodes = socket_inodes(pids)
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sorted({row[7] for row in rows if len(row) > 7 and row[6] in inodes and row[7].startswith("/")})


def _connect_as_another_user(sock, uid=65534):
    """errno of connecting to `sock` as user `uid` (0 if it connected)."""

    def connect():
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)

    return as_another_user(connect, uid)


def test_a_socket_folder_others_can_enter_is_refused(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(helpers.ServerError, match="private to you"):
        helpers.start_server(["m"], socket_path=folder / "vllm.sock", log_path=tmp_path / "log")


def test_server_that_dies_at_start_reports_its_log(tmp_path):
    with pytest.raises(helpers.ServerError, match="exited with code") as err:
        start_cpu_server(tmp_path / "no-such-model", tmp_path)
    assert "no-such-model" in str(err.value)  # the log tail names the cause


OOM_AT_START = (
    Path(__file__).resolve().parents[1] / "docs/runs/2026-12-05-h100-vllm034/moonlight-checkpoint-fp8.server.log"
)


def test_a_start_that_runs_out_of_memory_names_it_above_the_tail(tmp_path):
    """vLLM's log of a real start that ran out of GPU memory (FP8 experts beside a bf16 trainer on an 80 GB GPU):
    its last 40 lines only say "See root cause above", so the error quotes the log's first error, and says what
    ran out. A WARNING line that mentions an OSError comes earlier and is not taken for it."""
    from conftest import private_socket_path

    lines = OOM_AT_START.read_text().splitlines()
    oom_at = next(i for i, line in enumerate(lines) if "CUDA Error: out of memory" in line)
    warning_at = next(i for i, line in enumerate(lines) if "OSError: " in line)
    assert warning_at < oom_at < len(lines) - 40 and " WARNING " in lines[warning_at]
    replay = f"import sys; sys.stdout.write(open({str(OOM_AT_START)!r}).read()); sys.exit(1)"
    server = helpers.start_server(
        ["m"], socket_path=private_socket_path(), log_path=tmp_path / "log", launcher=(sys.executable, "-c", replay)
    )
    with pytest.raises(helpers.ServerError) as err:
        helpers.wait_until_healthy(server, timeout_s=60)
    helpers.stop_server(server)
    said = str(err.value)
    assert said.startswith(
        "vLLM server exited with code 1 during start; the first error in its log: "
        "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163; "
        "vLLM ran out of GPU memory while starting, beside what the trainer ranks hold on the same GPUs; "
        f"last lines of {tmp_path / 'log'}:\n"
    ), said[:400]
    assert said.endswith(
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
    )


def test_a_start_without_an_error_line_says_only_its_tail(tmp_path):
    """Only vLLM's WARNING line mentions an error, above the tail: nothing is quoted as the first error."""
    from conftest import private_socket_path

    warning = [line for line in OOM_AT_START.read_text().splitlines() if "OSError: " in line][0]
    replay = f"import sys; print({warning!r}); print('starting\\n' * 45); sys.exit(2)"
    server = helpers.start_server(
        ["m"], socket_path=private_socket_path(), log_path=tmp_path / "log", launcher=(sys.executable, "-c", replay)
    )
    with pytest.raises(helpers.ServerError) as err:
        helpers.wait_until_healthy(server, timeout_s=60)
    helpers.stop_server(server)
    assert str(err.value).startswith(f"vLLM server exited with code 2 during start; last lines of {tmp_path / 'log'}:")


FAKE_SERVER = """
import signal, subprocess, sys, time
# a child that ignores SIGTERM, like a wedged engine core
subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
time.sleep(120)
"""


def _ignores_sigterm(pid: int) -> bool:
    """Whether process `pid` ignores SIGTERM now (SigIgn in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def test_stop_kills_the_whole_group_even_what_ignores_sigterm(tmp_path):
    server = helpers.start_server(
        [],
        socket_path=private_socket_path(),
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", FAKE_SERVER),
    )
    try:
        with pytest.raises(helpers.ServerError, match="not healthy after"):
            helpers.wait_until_healthy(server, timeout_s=2)
        # Not a fixed wait: on a loaded machine the fake server may not have started its child
        # yet, or the child not yet ignored SIGTERM (a SIGTERM would then end it, proving nothing).
        deadline = time.monotonic() + 60
        while not (
            (members := helpers.group_members(server.pgid))
            and len(members) == 2
            and all(_ignores_sigterm(pid) for pid in members if pid != server.pgid)
        ):
            assert time.monotonic() < deadline, f"the fake server's group is {members}"
            time.sleep(0.1)
        helpers.stop_server(server, grace_s=1)
        assert helpers.group_members(server.pgid) == []
    finally:
        if helpers.group_members(server.pgid):
            os.killpg(server.pgid, signal.SIGKILL)


COUNTING_SERVER = """
import json, socketserver, sys, time
from http.server import BaseHTTPRequestHandler
connections, still_open = [], []

class Route(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # (keep-alive, as vLLM's server)

    def setup(self):
        super().setup()
        connections.append(self.client_address)
        still_open.append(self)

    def finish(self):
        super().finish()
        still_open.remove(self)

    def do_POST(self):  # an error reply that keeps the connection, to whatever is posted
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        body = json.dumps({"connections": len(connections), "open": len(still_open)}).encode()
        self.send_response(500 if self.path == "/fail" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path == "/fail":  # as vLLM's server may: drop the connection a moment after an error reply
            time.sleep(0.3)
            self.close_connection = True

    def address_string(self):
        return "local"

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

Server(sys.argv[sys.argv.index("--uds") + 1], Route).serve_forever()
"""


# A stand-in that answers a sync's calls as vLLM's server does, the prefix cache's reset slowly, and lists when
# each call began and ended (GET /calls). With REFUSED_RESETS=N it refuses the first N resets at once, as vLLM
# does while blocks are still held.
ORDER_SERVER = """
import json, os, socketserver, sys, time
from http.server import BaseHTTPRequestHandler
calls, refused = [], int(os.environ.get("REFUSED_RESETS", "0"))

class Route(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, value):
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        route = self.path.split("?")[0]
        calls.append("begin " + route)
        time.sleep(2 if route == "/reset_prefix_cache" and not refused else 0)
        calls.append("end " + route)
        resets = calls.count("end /reset_prefix_cache")
        self.reply({"status": "awake"} if route == "/wake_up" else {"success": resets > refused})

    def do_GET(self):
        self.reply(calls)

    def address_string(self):
        return "local"

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

Server(sys.argv[sys.argv.index("--uds") + 1], Route).serve_forever()
"""


def test_the_prefix_cache_is_reset_beside_the_sync_and_before_vllm_serves_again(tmp_path):
    """At sleep level 0 with the KV cache kept, sleep_for_sync returns once vLLM is paused, and its prefix cache
    is reset beside the send; wake_to_serve resumes serving only once the reset is through."""
    server = helpers.start_server(
        [], socket_path=private_socket_path(), log_path=tmp_path / "log", launcher=(sys.executable, "-c", ORDER_SERVER)
    )
    try:
        sock = healthy_or_stopped(server, timeout_s=120).socket_path
        assert helpers.sleep_for_sync(sock, 0, free_kv_cache=False) is False
        assert "end /sleep" in helpers.request(sock, "GET", "/calls")
        assert "end /reset_prefix_cache" not in helpers.request(sock, "GET", "/calls")  # (it takes 2 s there)
        helpers.wake_to_serve(sock, kv_cache=False)
        calls = helpers.request(sock, "GET", "/calls")
        assert calls.index("end /sleep") < calls.index("begin /reset_prefix_cache")
        assert calls.index("end /reset_prefix_cache") < calls.index("begin /wake_up")
    finally:
        helpers.stop_server(server)


@pytest.mark.parametrize("refused", [2, 5])
def test_a_prefix_cache_reset_vllm_refuses_is_tried_again_and_else_fails_the_round(tmp_path, refused):
    """vLLM answers {"success": false} while blocks are still held: the reset is tried again, a few times within
    a second, before vLLM serves; if it is refused every time, wake_to_serve fails, naming the reset, and never
    wakes vLLM to serve from the old weights' cache."""
    server = helpers.start_server(
        [],
        socket_path=private_socket_path(),
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", ORDER_SERVER),
        env={"REFUSED_RESETS": str(refused)},
    )
    try:
        sock = healthy_or_stopped(server, timeout_s=120).socket_path
        helpers.sleep_for_sync(sock, 0, free_kv_cache=False)
        if refused < 5:
            helpers.wake_to_serve(sock, kv_cache=False)
        else:
            with pytest.raises(helpers.ServerError, match=r'/reset_prefix_cache answered {"success": false} 5 times'):
                helpers.wake_to_serve(sock, kv_cache=False)
        resets = ["begin /reset_prefix_cache", "end /reset_prefix_cache"] * min(refused + 1, 5)
        woken = ["begin /wake_up", "end /wake_up"] if refused < 5 else []
        assert helpers.request(sock, "GET", "/calls") == ["begin /sleep", "end /sleep", *resets, *woken]
    finally:
        helpers.stop_server(server)


def _counting_server(tmp_path) -> helpers.Server:
    """Start COUNTING_SERVER as a server and wait until it is healthy."""
    server = helpers.start_server(
        [],
        socket_path=private_socket_path(),
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", COUNTING_SERVER),
    )
    return healthy_or_stopped(server, timeout_s=120)


def test_one_connection_per_server_kept_between_calls(tmp_path, monkeypatch):
    """The calls of a round reuse one connection to the server; one idle for
    half the server's keep-alive timeout is not reused (the server may be
    closing it), nor one that brought an error reply; stopping the server
    drops this process's client for it."""
    # 4 s: connections idle over 2 s are dropped, so that a loaded machine's pauses between the
    # five calls below (a few hundred ms at worst) do not drop one; the idle wait is 2.5 s.
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "4")
    server = _counting_server(tmp_path)
    try:
        sock = server.socket_path
        seen = [helpers.request(sock, "GET", "/connections")["connections"] for _ in range(5)]
        assert seen == [seen[0]] * 5, seen  # one connection for all five
        time.sleep(2.5)  # idle past half the keep-alive timeout
        assert helpers.request(sock, "GET", "/connections")["connections"] == seen[0] + 1
        with pytest.raises(helpers.ServerError, match="HTTP 500"):
            helpers.request(sock, "GET", "/fail")
        assert helpers.request(sock, "GET", "/connections")["connections"] == seen[0] + 2
    finally:
        helpers.stop_server(server)
    assert not [key for key in helpers._connections if key[2] == server.socket_path]


def test_the_servers_temporary_files_are_in_its_private_directory(cpu_server):
    """vLLM's engines meet at a FileStore in the temporary directory, which a stopped engine leaves behind:
    the server's is the socket's private directory, which its starter removes."""
    folder = Path(cpu_server.socket_path).parent
    assert list(folder.glob("vllm_dist_*")), sorted(p.name for p in folder.iterdir())


def test_a_failed_call_leaves_no_connection_open(tmp_path):
    """A call that brings an error reply, through request() or the OpenAI client, closes its connection:
    the server sees only the one the next call opens. A call from another thread has a client of its own."""
    server = _counting_server(tmp_path)
    try:
        sock = server.socket_path
        for _ in range(3):
            with pytest.raises(helpers.ServerError, match="HTTP 404"):
                helpers.collective_rpc(sock, "exact_check")
            with pytest.raises(helpers.ServerError, match="HTTP 404"):
                generation.post_completions(sock, model="tiny", prompt=[1, 2], max_tokens=1)
        # The server's thread sees a closed connection a moment after the client closes it.
        deadline = time.monotonic() + 5
        while (open_now := helpers.request(sock, "GET", "/connections")["open"]) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert open_now == 1
        in_thread = ThreadPoolExecutor(1).submit(helpers.request, sock, "GET", "/connections")
        assert in_thread.result(timeout=60)["open"] == 2  # its own connection; the main thread's stays
    finally:
        helpers.stop_server(server)
    # Every thread's is closed, the OpenAI client's too.
    assert not [
        key for t in (helpers._connections, helpers._openai_clients) for key in t if key[2] == server.socket_path
    ]


def test_forgetting_a_client_is_safe_beside_first_requests_in_other_threads(monkeypatch):
    """Other threads' first requests add their clients to the shared tables while this thread forgets its own,
    as after a failed call; the interpreter switches threads every microsecond to make them meet."""
    monkeypatch.setattr(helpers, "_connections", {})
    monkeypatch.setattr(helpers, "_openai_clients", {})
    added = {"connections": 0, "openai": 0}

    def first_requests(kind: str, make, count: int) -> None:
        for i in range(count):
            make(f"/nowhere/{kind}-{i}")  # no connection is opened until a request is sent
            added[kind] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with ThreadPoolExecutor(2) as pool:
            adding = [
                pool.submit(first_requests, "connections", helpers._connection, 4_000),
                pool.submit(first_requests, "openai", helpers.openai_client, 100),
            ]
            while not all(f.done() for f in adding):
                helpers.forget_client("/nowhere/else")
                helpers.forget_client("/nowhere/else", every_thread=True)
            for f in adding:
                f.result()
    finally:
        sys.setswitchinterval(interval)
    assert added == {"connections": 4_000, "openai": 100}
    assert len(helpers._connections) == 4_000 and len(helpers._openai_clients) == 100
    helpers.forget_client("/nowhere/connections-7", every_thread=True)
    assert len(helpers._connections) == 3_999


ENV_SERVER = """
import json, os
keys = ("VLLM_WORKER_MULTIPROC_METHOD", "TRITON_CACHE_DIR", "VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
"""


def _server_env(tmp_path, **start_kwargs) -> dict:
    server = helpers.start_server(
        [],
        socket_path=private_socket_path(),
        log_path=tmp_path / "log",
        launcher=(sys.executable, "-c", ENV_SERVER),
        **start_kwargs,
    )
    server.proc.wait(timeout=120)
    helpers.stop_server(server)
    line = next(line for line in server.log_path.read_text().splitlines() if line.startswith("ENV "))
    return json.loads(line[4:])


def test_the_servers_environment_takes_the_fast_start_defaults_unless_told_otherwise(tmp_path, monkeypatch):
    """The engines forked and one Triton cache, unless this process's
    environment (or `env`) says otherwise; the dev routes always on; Ray's GPU mask dropped."""
    for key in helpers.SERVER_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert _server_env(tmp_path) == {
        **helpers.SERVER_ENV_DEFAULTS,
        "VLLM_SERVER_DEV_MODE": "1",
        "CUDA_VISIBLE_DEVICES": None,
    }
    assert helpers.SERVER_ENV_DEFAULTS["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "0")
    seen = _server_env(tmp_path, env={"TRITON_CACHE_DIR": "/elsewhere"})
    assert seen["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and seen["TRITON_CACHE_DIR"] == "/elsewhere"
    assert seen["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_openai_client_works_as_the_readme_says(cpu_server):
    """The README's snippet, over the private socket: models, completions and
    chat (the presets ship a chat template)."""
    import httpx
    import openai

    client = openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="-",
        http_client=httpx.Client(transport=httpx.HTTPTransport(uds=cpu_server.socket_path)),
    )
    assert [m.id for m in client.models.list()] == [SERVED_NAME]
    completion = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_a_socket_directory_too_long_for_vllms_own_sockets_is_refused(tmp_path):
    import tempfile

    deep = Path(tempfile.mkdtemp(prefix="d" * (71 - len(tempfile.gettempdir()) - 1)))  # 71 bytes in all
    try:
        with pytest.raises(helpers.ServerError, match="too long for vLLM's own sockets"):
            helpers.start_server(["m"], socket_path=deep / "s", log_path=tmp_path / "log")
    finally:
        deep.rmdir()


def test_the_benchmarks_generation_throughput_counts_every_token_it_asked_for(cpu_server):
    """benchmark.py --throughput PROMPTSxTOKENS: that many completions of that
    many tokens each (EOS ignored), through the real server; tokens per
    second from the median batch. A malformed value is refused."""
    import argparse
    import statistics
    from types import SimpleNamespace

    from scripts import benchmark

    assert benchmark._throughput("64x256") == (64, 256)
    for bad in ("64", "0x8", "8x", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match="PROMPTSxTOKENS"):
            benchmark._throughput(bad)
    job = SimpleNamespace(server=cpu_server, served_name=SERVED_NAME, dp_size=1)
    result = benchmark.generation_throughput(job, 3, 5, repeats=2)
    assert result["generated_tokens"] == 15 and len(result["seconds"]) == 2, result
    assert result["tokens_per_s"] == pytest.approx(15 / statistics.median(result["seconds"]))


def test_a_server_started_without_flags_runs_its_launcher_only_once_given_them(tmp_path):
    """start_server(None) starts the process, which waits until Server.serve() gives it the `vllm serve` flags, and
    then runs the launcher module with them, in the environment it was started with and the one given then.
    Stopped before, it leaves nothing."""
    tests = str(Path(__file__).parent)
    start = dict(
        socket_path=private_socket_path(),
        env={"PYTHONPATH": tests, "GIVEN_AT_START": "yes"},
        launcher=(sys.executable, "-m", "env_echo"),
    )
    server = helpers.start_server(None, log_path=tmp_path / "told.log", **start)
    try:
        time.sleep(1)
        assert server.proc.poll() is None and "ECHO" not in (tmp_path / "told.log").read_text()
        server.serve(["model", "--flag", "1"], env={"GIVEN_LATER": "yes"})
        assert server.proc.wait(timeout=120) == 0
    finally:
        helpers.stop_server(server)
    echoed = next(line for line in (tmp_path / "told.log").read_text().splitlines() if line.startswith("ECHO "))
    sock = str(start["socket_path"])
    assert json.loads(echoed[5:]) == {"argv": ["serve", "model", "--flag", "1", "--uds", sock], "env": ["yes", "yes"]}
    assert f"$ vllm serve model --flag 1 --uds {sock}" in (tmp_path / "told.log").read_text()
    never_told = helpers.start_server(None, log_path=tmp_path / "never.log", **start)
    helpers.stop_server(never_told)
    assert helpers.group_members(never_told.pgid) == [] and never_told.proc.poll() is not None


def test_a_cpu_vllm_server_started_without_flags_serves_once_given_them(tiny_checkpoint, tmp_path):
    """The same with vLLM itself, its CPU launcher run as a module as vLLM's CLI is (`python -m`): it imports the
    launcher and what `vllm serve` imports first, and is healthy and serving once told."""
    server = helpers.start_server(
        None,
        socket_path=private_socket_path(),
        log_path=tmp_path / "server.log",
        env={"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])},
        launcher=(sys.executable, "-m", Path(CPU_LAUNCHER[1]).stem),
    )
    try:
        server.serve(cpu_serve_args(tiny_checkpoint))
        healthy_or_stopped(server, timeout_s=300)
        log = server.log_path.read_text()
        assert "importing vLLM early failed" not in log and "[wait for flags] vLLM imported in " in log
        assert 0 < server.serving_after_s < time.monotonic() - server.started_at
        assert len(generation.completions(server.socket_path, SERVED_NAME, ["Hello"], max_tokens=2)[0].token_ids) == 2
    finally:
        helpers.stop_server(server)


def test_the_gpu_ids_vllm_is_given_are_the_physical_ones(monkeypatch):
    """start_server drops CUDA_VISIBLE_DEVICES from the server's environment, so `--device-ids` must name the
    physical GPUs: under CUDA_VISIBLE_DEVICES=2,3 (as a user may run torchrun) a rank's cuda:1 is GPU 3; UUIDs
    and MIG names pass through as vLLM takes them."""
    for visible, index, physical in [("2,3", 1, "3"), (" 5 ", 0, "5"), ("", 1, "1"), ("GPU-ab,GPU-cd", 1, "GPU-cd")]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert helpers.physical_gpu_id(index) == physical, (visible, index)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert helpers.physical_gpu_id(2) == "2"
    assert (
        "--device-ids" in (flags := helpers.serve_args("m", ["3", "1"]))
        and flags[flags.index("--device-ids") + 1] == "3,1"
    )
    assert "dummy" in flags and "--load-format" not in helpers.serve_args("m", ["0"], dummy_weights=False)
