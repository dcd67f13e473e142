"""The vLLM server's life cycle and routes, on a real vLLM server on CPU."""

import socket
import sys

import pytest

import helpers
from conftest import SERVED_NAME, start_cpu_server


def test_health_world_size_and_sleep_state(cpu_server):
    assert helpers.health(cpu_server.url)
    assert helpers.get_world_size(cpu_server.url) == 1
    assert helpers.is_sleeping(cpu_server.url) is False


def test_weight_update_routes_and_server_error_text(cpu_server):
    url = cpu_server.url
    helpers.init_weight_transfer_engine(url, {"packed": True})
    helpers.start_weight_update(url)
    try:
        # A second start while one is active is refused; the error must carry
        # the server's own explanation, not just "HTTP 500".
        with pytest.raises(helpers.ServerError, match="(?i)active"):
            helpers.start_weight_update(url)
    finally:
        helpers.finish_weight_update(url)
    helpers.start_weight_update(url)  # finishing made a new update possible
    helpers.finish_weight_update(url)


def test_completions_are_greedy_and_carry_token_ids(cpu_server, tiny_checkpoint):
    from transformers import AutoTokenizer

    prompts = ["The capital of France is", "Hello, my name is"]
    first = helpers.completions(cpu_server.url, SERVED_NAME, prompts, max_tokens=6)
    second = helpers.completions(cpu_server.url, SERVED_NAME, prompts, max_tokens=6)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    for prompt, c in zip(prompts, first, strict=True):
        assert c.prompt_token_ids == tok(prompt).input_ids
        assert len(c.token_ids) == 6


def test_prompt_logprobs_one_per_token_after_the_first(cpu_server):
    ids = [5, 17, 99, 300, 42, 7]
    lps = helpers.prompt_logprobs(cpu_server.url, SERVED_NAME, ids)
    assert len(lps) == len(ids) - 1
    assert all(lp <= 0 for lp in lps)
    assert lps == helpers.prompt_logprobs(cpu_server.url, SERVED_NAME, ids, dp_rank=0)


def _listening_sockets(pids):
    """(ip, port) of every TCP socket in LISTEN state owned by `pids`."""
    inodes = set()
    for pid in pids:
        try:
            import os

            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    ip_hex, port_hex = local.split(":")
                    found.append((ip_hex, int(port_hex, 16)))
    return found


def test_server_listens_on_loopback_only(cpu_server):
    """Dev routes and pickled IPC handles must not be reachable from the network."""
    sockets = _listening_sockets(helpers.group_members(cpu_server.pgid))
    http = [ip for ip, port in sockets if port == cpu_server.port]
    assert http == ["0100007F"]  # 127.0.0.1, little-endian hex
    exposed = [
        (ip, port) for ip, port in sockets if ip not in ("0100007F", "0" * 24 + "01000000", "0" * 31 + "1")
    ]
    assert not exposed, f"server listens beyond loopback: {exposed}"


def test_server_that_dies_at_start_reports_its_log(tmp_path):
    with pytest.raises(helpers.ServerError, match="exited with code") as err:
        start_cpu_server(tmp_path / "no-such-model", tmp_path)
    assert "no-such-model" in str(err.value)  # the log tail names the cause


def test_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(helpers.ServerError, match=f"port {port} .* already in use"):
            helpers.start_server(["m"], port=port, log_path=tmp_path / "log")


def test_a_port_left_in_time_wait_counts_as_free():
    """A run right after a stopped server must not be refused: the stopped
    server's connections linger in TIME_WAIT on its port, which the next
    server (SO_REUSEADDR) can bind."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server (uvicorn) does
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what a check without SO_REUSEADDR would see
    assert helpers.port_is_free(port)


FAKE_SERVER = """
import signal, subprocess, sys, time
# a child that ignores SIGTERM, like a wedged engine core
subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
time.sleep(120)
"""


def test_stop_kills_the_whole_group_even_what_ignores_sigterm(tmp_path):
    server = helpers.start_server(
        [], port=helpers.free_port(), log_path=tmp_path / "log", launcher=(sys.executable, "-c", FAKE_SERVER)
    )
    with pytest.raises(helpers.ServerError, match="not healthy after"):
        helpers.wait_until_healthy(server, timeout_s=2)
    assert len(helpers.group_members(server.pgid)) == 2
    helpers.stop_server(server, grace_s=1)
    assert helpers.group_members(server.pgid) == []


def test_weight_checker_and_stop_on_a_dummy_weight_server(tmp_path):
    """/weight_checker (used by --check-coverage), then stop: nothing may remain."""
    model = helpers.build_preset_model("tiny", tmp_path / "tiny")
    server = start_cpu_server(model, tmp_path, "--load-format", "dummy")
    dummy = helpers.weight_checker(server.url, "checksum")["checksums"]
    assert dummy and all(key.startswith("dp0:") for key in dummy)
    assert helpers.weight_checker(server.url, "compare", baseline=dummy) == {"match": True, "mismatches": []}
    # The direct loader's fingerprints (how the benchmark proves it equals vLLM's loader).
    (stored,) = helpers.collective_rpc(server.url, "direct_load_fingerprint", "store")
    assert stored == {"dp_rank": 0, "parameters": 21}
    (same,) = helpers.collective_rpc(server.url, "direct_load_fingerprint", "compare")
    assert same["differ"] == []
    helpers.weight_checker(server.url, "reset")
    with pytest.raises(helpers.ServerError, match=r"DP rank 0: \d+ of 21 parameters differ.*embed_tokens"):
        helpers.collective_rpc(server.url, "direct_load_fingerprint", "compare")
    zeros = helpers.weight_checker(server.url, "checksum")["checksums"]
    assert set(zeros) == set(dummy)
    changed = set(helpers.weight_checker(server.url, "compare", baseline=dummy)["mismatches"])
    # Seen on CPU: reset leaves the attention and router linears' checksums as
    # they were (CPU-specific weight handling), so only these are asserted here;
    # --check-coverage itself needs a GPU.
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "lm_head.weight",
    ):
        assert f"dp0:pp0:pcp0:tp0:{name}" in changed, sorted(changed)

    members = helpers.group_members(server.pgid)
    assert len(members) >= 2  # API server + engine core at least
    helpers.stop_server(server)
    assert helpers.group_members(server.pgid) == []
    assert helpers.port_is_free(server.port)
