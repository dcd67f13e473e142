"""Flag validation, input errors caught before GPU work, and the reported numbers."""

import json
import math
import socket

import pytest

import helpers
import rlhf_ipc_fsdp_ep as script


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--num-gpus", "3", "--tensor-parallel-size", "2"],
            "--num-gpus 3 is not divisible by --tensor-parallel-size 2",
        ),
        (["--num-gpus", "0"], "--num-gpus must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be between 0 and 1"),
        (["--rounds", "0"], "--rounds, --max-tokens and --samples-per-prompt must be at least 1"),
        (["--samples-per-prompt", "0"], "--rounds, --max-tokens and --samples-per-prompt must be at least 1"),
        (["--sleep-level", "3"], "invalid choice"),
        (["--no-packed"], "--weight-loader direct reads packed buffers"),
        (
            ["--num-gpus", "4", "--tensor-parallel-size", "2"],
            "--weight-loader direct needs --tensor-parallel-size 1",
        ),
        (["--weight-loader", "nccl"], "invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in [
        "--model",
        "--num-gpus",
        "--tensor-parallel-size",
        "--packed",
        "--no-packed",
        "--packed-buffer-size-bytes",
        "--gpu-memory-utilization",
        "--port",
        "--sleep-level",
        "--max-tokens",
        "--prompt",
        "--rounds",
        "--logprob-mean-tolerance",
        "--logprob-max-tolerance",
        "--json",
        "--train",
        "--lr",
        "--samples-per-prompt",
        "--temperature",
        "--memory-growth-tolerance-gib",
        "--check-coverage",
        "--weight-loader",
    ]:
        assert flag in text


def test_defaults_match_the_reference_setup():
    args = script.parse_args([])
    assert (args.model, args.num_gpus, args.tensor_parallel_size) == ("Qwen/Qwen3-30B-A3B", 4, 1)
    assert args.packed and args.packed_buffer_size_bytes == 1024**3
    assert args.weight_loader == "direct"
    assert args.prompts == script.DEFAULT_PROMPTS


def test_missing_model_path_is_reported(tmp_path):
    with pytest.raises(SystemExit, match="has no config.json"):
        script.resolve_model(str(tmp_path / "nope"), tmp_path)


def test_unreachable_hub_model_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="could not download 'nobody/no-such-model'"):
        script.resolve_model("nobody/no-such-model", tmp_path)


def test_presets_are_built_locally(tmp_path):
    path = script.resolve_model("tiny", tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["num_experts"] == 8 and config["head_dim"] >= 32
    assert (path / "tokenizer.json").is_file()


def test_packed_buffer_smaller_than_largest_parameter_is_refused(tmp_path):
    path = script.resolve_model("tiny", tmp_path)
    name, size = helpers.largest_parameter(path)
    assert (name, size) == ("model.embed_tokens.weight", 1024 * 128 * 2)
    args = script.parse_args(
        ["--packed-buffer-size-bytes", str(size - 1), "--port", str(helpers.free_port())]
    )
    with pytest.raises(SystemExit, match=f"smaller than the largest parameter, {name} \\({size} bytes\\)"):
        script.check_before_gpu_work(args, path)
    args.packed_buffer_size_bytes = size
    script.check_before_gpu_work(args, path)  # exactly enough is fine


def test_direct_loader_refuses_experts_that_do_not_split_evenly(tmp_path):
    path = script.resolve_model("tiny", tmp_path)  # 8 experts
    args = script.parse_args(["--num-gpus", "3", "--port", str(helpers.free_port())])
    with pytest.raises(SystemExit, match="8 experts do not split evenly over 3 GPUs.*--weight-loader vllm"):
        script.check_before_gpu_work(args, path)
    args.num_gpus = 4
    script.check_before_gpu_work(args, path)
    args.num_gpus, args.weight_loader = 3, "vllm"
    script.check_before_gpu_work(args, path)  # vLLM's loader takes any split


def test_30b_shape_fits_the_default_buffer(tmp_path):
    path = script.resolve_model("qwen3-30b-a3b-shape", tmp_path)
    name, size = helpers.largest_parameter(path)
    assert name.endswith("experts.gate_up_proj") and size == 128 * 2 * 768 * 2048 * 2 < 1024**3


def test_busy_port_is_refused_before_gpu_work(tmp_path):
    path = script.resolve_model("tiny", tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        args = script.parse_args(["--port", str(sock.getsockname()[1])])
        with pytest.raises(SystemExit, match="already in use"):
            script.check_before_gpu_work(args, path)


def test_main_stops_on_bad_input_before_starting_anything(tmp_path):
    with pytest.raises(SystemExit, match="has no config.json"):
        script.main(["--model", str(tmp_path / "missing")])


def test_serve_args_pin_the_server_to_the_trainers_gpus(tmp_path):
    args = script.parse_args(
        ["--num-gpus", "4", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.4"]
        + ["--weight-loader", "vllm"]
    )
    flags = script.serve_args(args, tmp_path, "m", ["3", "1", "0", "2"])
    assert flags[0] == str(tmp_path)

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert value("--data-parallel-size") == "2" and value("--tensor-parallel-size") == "2"
    assert value("--device-ids") == "3,1,0,2"
    assert json.loads(value("--weight-transfer-config")) == {"backend": "ipc"}
    assert value("--load-format") == "dummy" and value("--gpu-memory-utilization") == "0.4"
    assert "--enable-expert-parallel" in flags and "--enable-sleep-mode" in flags
    assert value("--worker-extension-cls") == "direct_load.DirectLoadWorker"
    assert "--enforce-eager" not in flags


def test_logprob_diff():
    d = helpers.logprob_diff([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]])
    assert (d.max_abs, d.mean_abs, d.count) == (1.0, 0.5, 3)
    assert math.isnan(helpers.logprob_diff([[0.0]], [[math.nan]]).max_abs)
    with pytest.raises(ValueError):
        helpers.logprob_diff([[0.0, 1.0]], [[0.0]])


MEMORY = [{"trainer_peak_allocated": 1.0, "trainer_reserved": 2.0, "device_used": 50.0}]


def _gap(max_abs, mean_abs=0.01, server=(-1.0,)):
    return {
        "max_abs": max_abs,
        "mean_abs": mean_abs,
        "max_abs_per_dp_rank": [max_abs],
        "server": [[list(server)]],
    }


TOLERANCES = {"mean": 0.1, "max": 1.0}


def _round(after_max, after_mean=0.01, weights_updated=True, server_moved=True, memory=MEMORY):
    phases = {"sleep": 0.25, "wake_weights": 0.25, "send": 2.0, "wake_kv": 0.5}
    before = _gap(2.0, mean_abs=1.0)
    after = _gap(after_max, mean_abs=after_mean, server=(-2.0,) if server_moved else (-1.0,))
    sync = script.Sync(phases, send_per_rank=[{"source": 0.5, "total": 2.0}])
    return script.round_record(sync, 4 * 10**9, before, after, TOLERANCES, memory, weights_updated)


def test_default_tolerances_are_the_documented_ones():
    args = script.parse_args([])
    assert {"mean": args.logprob_mean_tolerance, "max": args.logprob_max_tolerance} == TOLERANCES


def test_round_record_gates_and_derives_rates():
    r = _round(0.3)  # a single-token outlier below the max guard passes
    assert r["cycle_s"] == 3.0 and r["send_gb_per_s"] == 2.0 and r["gate_passed"] is True
    assert r["logprobs_changed"] is True and r["mem_reserved_gib"] == [2.0]
    assert _round(0.3, after_mean=0.2)["gate_passed"] is False  # every token off: wrong weights
    assert _round(1.5)["gate_passed"] is False  # one token grossly off
    assert _round(math.nan)["gate_passed"] is False  # NaN never passes
    assert _round(0.3, after_mean=math.nan)["gate_passed"] is False


def test_a_sync_that_did_nothing_fails_the_round():
    # The trainer's weights moved but vLLM's log-probabilities did not.
    stale = _round(0.1, weights_updated=True, server_moved=False)
    assert stale["logprobs_changed"] is False and stale["gate_passed"] is False
    # Nothing trained, nothing changed: fine (e.g. a second sync of the same weights).
    assert _round(0.1, weights_updated=False, server_moved=False)["gate_passed"] is True


def _memory(device_used):
    return [{"trainer_peak_allocated": 1.0, "trainer_reserved": 2.0, "device_used": device_used}]


def test_memory_growth_is_measured_from_round_2():
    rounds = [_round(0.1, memory=_memory(u)) for u in (40.0, 50.0, 50.1, 50.3)]
    assert script.memory_growth_gib(rounds) == pytest.approx(0.3)  # round 1's 10 GiB of setup excluded
    assert script.memory_growth_gib(rounds[:2]) == 0.0


def test_failed_checks_name_what_failed():
    ok = {"rounds": [_round(0.1)], "coverage": None, "memory_growth_gib": 0.1}
    assert script.failed_checks(ok, 0.5) == []
    bad = {
        "rounds": [_round(0.1), _round(0.9, after_mean=0.5)],
        "coverage": {"parameters": 3, "unwritten": ["dp1:pp0:pcp0:tp0:x"]},
        "memory_growth_gib": 2.0,
    }
    assert script.failed_checks(bad, 0.5) == [
        "round 2: logprob gate",
        "the sync did not write 1 vLLM parameters",
        "GPU memory grew 2.00 GiB from round 2 to the last (tolerance 0.5 GiB)",
    ]
    assert script.failed_checks({**ok, "memory_growth_gib": math.nan}, 0.5)  # NaN is a failure


def test_reward_and_advantages():
    assert script.reward("") == 0.0
    assert script.reward("ab c") == 1.0
    assert script.reward("aB1!") == 0.25
    batch = [
        helpers.Completion("abcd", [1, 2], [3, 4]),
        helpers.Completion("AB!!", [1, 2], [5, 6]),
        helpers.Completion("", [1, 2], []),  # no tokens: nothing to learn from
    ]
    samples, mean = script.training_samples(batch)
    assert mean == pytest.approx(1 / 3)
    assert [s["completion_ids"] for s in samples] == [[3, 4], [5, 6]]
    assert [s["advantage"] for s in samples] == pytest.approx([2 / 3, -1 / 3])


def test_summary_table_and_json_keys():
    rounds = [_round(0.1), _round(0.3, after_mean=0.02, server_moved=False), _round(0.1)]
    for r, reward in zip(rounds, (0.5, 0.6, 0.7), strict=True):
        r["phases_s"]["train"] = 1.5
        r.update(reward_mean=reward, loss=0.1)
    result = {
        "gpu_name": "NVIDIA H200",
        "num_gpus": 2,
        "model": "tiny",
        "vllm_version": "0.32.0",
        "command": "python rlhf_ipc_fsdp_ep.py",
        "server_start_s": 100.0,
        "rounds": rounds,
        "memory_gib_per_rank": MEMORY,
        "memory_growth_gib": 0.25,
    }
    text = helpers.format_summary(result)
    lines = text.splitlines()
    assert "2 x NVIDIA H200" in lines[0]
    row1, row2, _ = (line for line in lines if line.lstrip().startswith(("1 |", "2 |", "3 |")))
    assert "| pass |" in row1 and "| FAIL |" in row2
    assert "3.00 s" in row1 and "4.000GB" in row1 and row1.endswith("1.50 s | 0.500")
    assert "GPU memory growth, round 2 -> last: +0.250 GiB" in text
    # The JSON round-trips with the keys promised in the README.
    loaded = json.loads(json.dumps(result))
    for key in (
        "phases_s",
        "cycle_s",
        "bytes_sent",
        "max_abs_dlogp_before",
        "max_abs_dlogp_after",
        "gate_passed",
        "reward_mean",
        "logprobs_changed",
        "mem_reserved_gib",
    ):
        assert key in loaded["rounds"][0]
    assert set(helpers.SYNC_PHASES) <= set(loaded["rounds"][0]["phases_s"])


def test_script_without_enough_gpus_fails_with_one_clear_line(tmp_path):
    """End to end through the command line: Ray finds no GPU here."""
    import subprocess
    import sys

    port = helpers.free_port()
    proc = subprocess.run(
        [sys.executable, "rlhf_ipc_fsdp_ep.py", "--model", "tiny", "--num-gpus", "2", "--port", str(port)],
        cwd=script.__file__.rsplit("/", 1)[0],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "error: asked for 2 GPUs but the Ray cluster has 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert helpers.port_is_free(port)


def test_benchmark_flags_and_where_its_json_goes():
    import benchmark

    bench, args = benchmark.parse_args(["--model", "tiny", "--num-gpus", "2"])
    assert bench.loaders == ["vllm", "direct"] and args.rounds == 3  # the benchmark's default
    assert (args.model, args.num_gpus) == ("tiny", 2)  # the script's own flags pass through
    bench, args = benchmark.parse_args(["--loaders", "direct", "--rounds", "5"])
    assert bench.loaders == ["direct"] and args.rounds == 5
    facts = {"gpu_name": "NVIDIA H200", "date": "2026-11-30", "model": "qwen3-30b-a3b-shape", "num_gpus": 2}
    assert str(benchmark.default_out(facts)) == "docs/benchmarks/2026-11-30-qwen3-30b-a3b-shape-2xh200.json"
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--loaders", "nccl"])
