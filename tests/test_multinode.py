# SPDX-License-Identifier: Apache-2.0
"""More than one node, on a two-node Ray cluster in one process
tree: where the trainer ranks go, what each node's `vllm serve` is told, and
how a server on another node that fails is reported and cleaned up. The
driver runs in its own process (multinode_driver.py); these tests read what it saw."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_ipc_fsdp_ep as script

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("multinode")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "multinode_driver.py"), str(out / "seen.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (out / "seen.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "seen.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return result


def test_ranks_go_in_node_order_one_node_each_rank_0_on_the_drivers(seen):
    placements = seen["placements"]
    assert [p["rank"] for p in placements] == [0, 1]
    assert placements[0]["node"] == seen["driver_node"] != placements[1]["node"]
    assert seen["strategy"] == "STRICT_SPREAD"
    assert seen["layout"] == [["0"], ["0"]]  # each node's own GPU ids, as Ray gave them
    assert seen["all_reduce"] == [3.0, 3.0]  # one process group across the nodes


def test_the_drivers_settings_reach_the_other_node_but_not_its_address(seen):
    assert seen["node1_env"]["NCCL_SOCKET_IFNAME"] == "from-the-driver"
    assert seen["node1_env"]["VLLM_HOST_IP"] != "the-drivers-own"


def test_a_node_server_talks_gloo_on_the_interface_of_its_nodes_address(seen):
    assert seen["node1_interface"]  # this machine's interface with the nodes' address (both nodes are here)
    assert f"engines starting, gloo on {seen['node1_interface']}" in seen["node1_log"]


def test_the_first_node_must_hold_its_share_of_the_gpus(seen):
    assert "this node has 1 GPUs in Ray, and needs 2" in seen["one_node_for_two"]


def test_each_node_serves_its_own_gpus_and_the_first_one_runs_the_api(seen):
    head, node0, node1 = seen["head"], seen["flags"][0], seen["flags"][1]

    def value(flags, flag):
        return flags[flags.index(flag) + 1]

    for flags in (node0, node1):
        assert value(flags, "--data-parallel-size") == "2" and value(flags, "--data-parallel-size-local") == "1"
        assert value(flags, "--data-parallel-address") == head[0]
        assert value(flags, "--data-parallel-rpc-port") == str(head[1])
        assert value(flags, "--device-ids") == "0"
    assert "--headless" not in node0 and "--data-parallel-start-rank" not in node0
    assert "--headless" in node1 and value(node1, "--data-parallel-start-rank") == "1"


def test_a_node_server_that_exits_at_start_ends_the_wait_naming_the_node(seen):
    error = seen["failed_start"]
    assert error.startswith("NodeServerFailed: the vLLM server on node 1 (")  # a ServerError
    assert "exited with code 3" in error and "no GPU on this node" in error
    assert seen["failed_start_s"] < 60  # not wait_until_ready's 120 s


def test_a_node_server_that_dies_mid_run_is_named_with_the_request_that_saw_it(seen):
    assert seen["running_failure"] is None
    assert "the vLLM server on node 1" in seen["died_mid_run"] and "exited with code -9" in seen["died_mid_run"]
    assert "seen here as: POST /sleep failed" in seen["died_mid_run"]


def test_a_lost_node_actor_takes_its_server_with_it(seen):
    assert seen["orphan_alive_after_s"] is None
    assert seen["left_after_stops"] == []  # no server and no watchdog of any of the three starts
    assert "server.node1.log" in seen["log_files"]


def test_num_nodes_must_split_the_gpus_evenly():
    with pytest.raises(SystemExit):
        script.parse_args(["--num-gpus", "3", "--num-nodes", "2"])
    script.parse_args(["--num-gpus", "4", "--num-nodes", "2"])


def test_one_node_keeps_the_single_node_flags():
    args = script.parse_args(["--num-gpus", "2", "--model", "m"])
    flags = script.serve_args(args, ["0", "1"])
    assert not {"--headless", "--data-parallel-address", "--data-parallel-size-local"} & set(flags)


def test_a_send_that_fails_with_a_dead_node_names_it_at_once_and_is_not_sent_again(seen):
    error = seen["send_with_a_dead_node"]
    assert error.startswith("NodeServerFailed: the vLLM server on node 1 (") and "exited with code -9" in error
    assert "seen here as: a trainer rank: POST /collective_rpc timed out (simulated)" in error
    assert seen["sends_with_a_dead_node"] == [1, 1]  # not sent again
    assert seen["send_with_a_dead_node_s"] < 30


def test_the_other_nodes_serve_the_model_directory_the_driver_resolved(seen):
    """`--model ckpt`, relative to the driver's directory: node 1's server is
    given the absolute path, not `ckpt` (its actor's directory is another)."""
    assert seen["node1_serves"] == seen["ckpt"]
    assert seen["ckpt"].startswith("/")


def test_the_other_nodes_build_a_preset_of_their_own(seen):
    """A preset's name and resolve_model: node 1's server gets a directory with
    the preset's config, built there; and the script passes that resolver."""
    assert seen["node1_preset_config"] and seen["node1_preset_config"] != "tiny"
    assert seen["node1_resolver"] == "resolve_model"
