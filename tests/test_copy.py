# SPDX-License-Identifier: Apache-2.0
"""The README's copy section is true: each file its table names imports with only the files its last column
names beside it, in an empty directory with nothing else of this project on the path; its line counts are the
files'; its snippet uses only names it defines, imports or calls yours. Users' own RL code runs there: a
torchrun trainer through both loaders (tests/torchrun_rl.py), a Ray trainer with the direct loader's check
before a send (tests/lifted_rl.py), and one with vLLM's own loader (tests/ray_trainer_rl.py)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import helpers
from conftest import CPU_LAUNCHER, cpu_serve_args

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ["helpers.py"]
DIRECT = ["weight_sync/sources.py", "weight_sync/direct_load.py", "weight_sync/vllm_adapter.py"]
RAY = ["weight_sync/ray_trainers.py"]
NOT_COPIED = [
    "rlhf_ipc_fsdp_ep.py",
    "proof/program.py",
    "proof/rounds.py",
    "proof/preflight.py",
    "proof/logprob_gate.py",
    "proof/rank_measurement.py",
    "proof/exact_check_driver.py",
    "proof/exact_check_engine.py",
    "proof/exact_placement.py",
    "proof/exact_derived.py",
    "proof/exact_accounting.py",
    "proof/fingerprint.py",
    "proof/coverage.py",
    "proof/memory.py",
    "proof/report.py",
    "proof/toy_rl.py",
    "scripts/benchmark.py",
]  # the rows that say "nothing"


def copy_table() -> list[tuple[list[str], list[str]]]:
    """(the files of a row, the files it needs beside them), per row of the table."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Copy it into your RL code") :].split("\n## ", 1)[0]
    py, rows = re.compile(r"`([a-z0-9_/]+\.py)`"), []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((py.findall(cells[0]), py.findall(cells[2])))
    return rows


ROWS = copy_table()


def copied(folder: Path, files: list[str]) -> Path:
    """`files` copied into `folder` at their paths here, a package's __init__.py with its files."""
    folder.mkdir(exist_ok=True)
    for f in files:
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, folder / f)
        if (init := Path(f).parent / "__init__.py") != Path("__init__.py") and (ROOT / init).exists():
            shutil.copy(ROOT / init, folder / init)
    return folder


def alone(folder: Path) -> dict:
    """An environment in which only `folder` is importable of this project (Ray's workers inherit it)."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(folder)}


def python_alone(folder: Path, code: str) -> subprocess.CompletedProcess:
    """Run `code` in `folder` with only that folder importable of this project (-I: no PYTHONPATH, no user site)."""
    return subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, '.')\n{code}"],
        cwd=folder,
        capture_output=True,
        text=True,
        env=alone(folder),
        timeout=240,
    )


def test_the_table_is_there():
    assert [files for files, _ in ROWS][:3] == [HELPERS, DIRECT, RAY]
    assert [needs for _, needs in ROWS][:3] == [[], HELPERS, HELPERS]
    not_copied = sum((files for files, needs in ROWS if not needs and files[0] in NOT_COPIED), [])
    assert sorted(not_copied) == sorted(NOT_COPIED)


def test_helpers_imports_nothing_of_this_project(tmp_path):
    """helpers.py alone in an empty directory imports: whatever of this project it
    uses, it imports where it uses it (and says so), not when it is imported."""
    folder = copied(tmp_path / "alone", ["helpers.py"])
    run = python_alone(folder, "import helpers")
    assert run.returncode == 0, run.stderr[-1500:]


def test_helpers_imports_without_ray(tmp_path):
    """A torchrun trainer needs no Ray: helpers.py imports it only where a function uses it, and its
    process-group calls run without it."""
    folder = copied(tmp_path / "alone", ["helpers.py"])
    code = (
        "sys.modules['ray'] = None  # as if Ray were not installed\n"
        "import helpers\n"
        "print(helpers.rank_gpus(), helpers.on_rank_zero(len, 'abc'))\n"
    )
    run = python_alone(folder, code)
    assert run.returncode == 0, run.stderr[-1500:]
    assert run.stdout.strip() == "[{'gpu_id': None, 'gpu_uuid': ''}] 3", run.stdout


def test_helpers_imports_nothing_of_this_project_even_inside_a_function():
    """Not even lazily: every import statement in helpers.py, at any depth, is of the standard library or
    of a package installed with vLLM (more nodes' rendezvous is passed in: start_trainers' `rendezvous`)."""
    import ast

    tree = ast.parse((ROOT / "helpers.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    ours = {"weight_sync", "proof", "rlhf_ipc_fsdp_ep", "scripts", "tests"}
    assert not {name for name in imported if name.split(".")[0] in ours}, imported
    assert not re.search(r"import_module|__import__", (ROOT / "helpers.py").read_text())


def test_the_ray_trainers_refuse_more_nodes_and_name_what_to_copy(tmp_path):
    """helpers.py with weight_sync/ray_trainers.py alone cannot start trainer ranks on two nodes (they meet over
    TCP, through weight_sync/multinode.py): it says so at once, before it asks Ray for anything."""
    folder = copied(tmp_path / "alone", HELPERS + RAY)
    code = (
        "import ray\n"
        "from weight_sync import ray_trainers\n"
        "try:\n"
        "    ray_trainers.start_trainers(object, 2, num_nodes=2)\n"
        "except ValueError as e:\n"
        "    print('refused:', e, '| ray started:', ray.is_initialized())\n"
    )
    run = python_alone(folder, code)
    assert run.returncode == 0, run.stderr[-1500:]
    assert "refused: trainer ranks on 2 nodes meet over TCP" in run.stdout, run.stdout + run.stderr[-1500:]
    assert (
        "copy weight_sync/multinode.py beside it" in run.stdout and "rendezvous=multinode.TCPRendezvous" in run.stdout
    )
    assert run.stdout.rstrip().endswith("| ray started: False"), run.stdout


def copy_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme[readme.index("## Copy it into your RL code") :].split("\n## ", 1)[0]


def test_the_copy_sections_line_counts_are_the_files():
    """The lines a user copies for each path, as the README says them (to the nearest 10): vLLM's loader alone,
    the direct loader, and the Ray trainer ranks."""
    section = " ".join(copy_section().split())

    said = {
        "helpers": r"`helpers.py` alone is enough \(([\d,]+) lines",
        "direct": r"second row \(([\d,]+) lines in all\)",
        "ray": r"`weight_sync/ray_trainers.py` \(([\d,]+)\)",
    }
    counts = {k: int(re.search(pattern, section)[1].replace(",", "")) for k, pattern in said.items()}
    actual = {
        "helpers": len((ROOT / "helpers.py").read_text().splitlines()),
        "direct": sum(len((ROOT / f).read_text().splitlines()) for f in HELPERS + DIRECT + ["weight_sync/__init__.py"]),
        "ray": len((ROOT / RAY[0]).read_text().splitlines()),
    }
    assert all(abs(counts[k] - actual[k]) <= 10 for k in said), (counts, actual)


def test_the_copy_sections_snippet_uses_only_what_it_defines_imports_or_calls_yours():
    """Every name the README's snippet reads is imported or assigned in it, a builtin, or one the text before it
    says is yours; and every call of helpers.py and sources.py that the torchrun trainer makes to sync is in the
    section (the rest of that file only checks the sync)."""
    import ast
    import builtins

    section = copy_section()
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    tree = ast.parse(snippet)
    bound = {
        a.asname or a.name.split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    yours = set(re.findall(r"`(\w+)`", section.split("```python", 1)[0].strip().rsplit("\n\n", 1)[-1]))
    assert read - bound - set(dir(builtins)) <= yours, (read - bound - set(dir(builtins)), yours)
    assert {"model", "train_step"} <= yours
    user = ast.parse((ROOT / "tests" / "torchrun_rl.py").read_text())
    called = {
        n.attr
        for n in ast.walk(user)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("helpers", "sources")
    }
    checking = {"request", "start_time", "openai_client", "DEFAULT_LAUNCHER"}  # the file's checks, not its sync
    assert {name for name in called - checking if f"{name}(" not in section and f".{name}" not in section} == set()


def test_each_row_imports_beside_only_what_it_names(tmp_path):
    runs = {}
    for k, (files, needs) in enumerate(r for r in ROWS if r[0][0] not in NOT_COPIED):
        folder = copied(tmp_path / f"row{k}", files + needs)
        code = "".join(f"import {f.removesuffix('.py').replace('/', '.')}\n" for f in files)
        code = f"import sys; sys.path.insert(0, '.')\n{code}"  # -I: no PYTHONPATH, no user site; this folder only
        runs[", ".join(files)] = subprocess.Popen(
            [sys.executable, "-I", "-c", code], cwd=folder, stderr=subprocess.PIPE, text=True, env=alone(folder)
        )
    failed = {row: run.communicate(timeout=240)[1][-1500:] for row, run in runs.items()}
    assert not {row: err for row, err in failed.items() if runs[row].returncode}, failed


def test_the_lift_runs_a_users_own_trainer(tmp_path, tiny_checkpoint):
    folder = copied(tmp_path / "my_rl", HELPERS + DIRECT + RAY)  # the direct loader, under Ray
    shutil.copy(ROOT / "tests" / "lifted_rl.py", folder)
    flags = cpu_serve_args(tiny_checkpoint, worker="weight_sync.direct_load.DirectLoadWorker")[1:]  # what the lift has
    argv = [sys.executable, "lifted_rl.py", str(tiny_checkpoint), json.dumps(flags), json.dumps(CPU_LAUNCHER)]
    run = subprocess.run(argv, cwd=folder, env=alone(folder), capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    assert "ranks [0, 1]" in out and "same names and shapes on every rank: True" in out
    blocks = json.loads(out.split("expert blocks: ", 1)[1].split("\n", 1)[0])
    assert blocks and all(shape[0] == 4 for shape in blocks.values()), blocks  # 8 experts: each rank its 4
    assert "one rank: passed" in out, out
    assert re.search(r"two ranks: refused: .*holds experts 0\.\.7 .* sends experts 0\.\.3", out), out
    assert "health: True" in out


def test_a_ray_trainer_syncs_through_vllms_loader_beside_helpers_and_ray_trainers_alone(
    tmp_path, tiny_dense_checkpoint
):
    """helpers.py and weight_sync/ray_trainers.py ALONE in an empty folder beside a user's script
    (tests/ray_trainer_rl.py), called as the README shows: its own trainer class, FSDP2 over 2 Ray ranks on gloo, vLLM's ModuleSource
    over a dense model (tiny Qwen3), and a real CPU vLLM server started with `serving([model,
    *serve_args(name, gpu_ids)])`: dummy weights, vLLM's default worker (serve_args names no extension).

    What it checks: ModuleSource's names and shapes are the checkpoint's; rank 0's client
    (helpers.WeightSyncClient in FailAfterSend) makes its real calls to vLLM's weight routes
    (/init_weight_transfer_engine, /start_weight_update, /finish_weight_update); after the tensors
    ModuleSource yields are loaded by vLLM's own loader (reload_weights: model.load_weights, as the IPC
    engine's receive_weights calls it), every parameter vLLM holds differs from its dummy weights and
    equals, bit for bit, what vLLM's loader makes of the checkpoint itself; and helpers stops the server
    with nothing left: its process group empty, its watchdog gone.

    What it does not do on CPU: the IPC data plane and sleep mode. vLLM's IPC trainer engine
    (helpers.weight_sender) asks torch.cuda for the GPU's UUID when it is built and shares each packed
    chunk as a CUDA IPC handle, and the server's receive_weights rebuilds the handles with
    rebuild_cuda_tensor: neither exists without a GPU, and the tests do not stand in for them. The
    tensors travel through a file instead, to the same loader; the same program does the real sync on a
    GPU (docs/RESULTS.md). The CPU launcher drops the two flags vLLM on CPU refuses (sleep mode, the
    GPU ids)."""
    folder = copied(tmp_path / "my_rl", HELPERS + RAY)
    shutil.copy(ROOT / "tests" / "ray_trainer_rl.py", folder)
    assert sorted(p.name for p in folder.iterdir()) == ["helpers.py", "ray_trainer_rl.py", "weight_sync"]
    argv = [sys.executable, "ray_trainer_rl.py", str(tiny_dense_checkpoint), json.dumps(CPU_LAUNCHER)]
    run = subprocess.run(argv, cwd=folder, env=alone(folder), capture_output=True, text=True, timeout=600)
    out = run.stdout
    print(out)
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    flags = json.loads(out.split("serve flags: ", 1)[1].split("\n", 1)[0])
    assert flags == helpers.serve_args(
        "tiny", ["0"], experts=False, enforce_eager=True, max_model_len=512, kv_cache_tokens=1024
    ), flags
    assert "--worker-extension-cls" not in flags and "dummy" in flags, flags
    assert "ranks [0, 1]" in out and "same metadata on every rank: True" in out, out
    assert re.search(r"ModuleSource's names and shapes are the checkpoint's: True \d+", out), out
    assert "weight routes round trip: True" in out, out
    assert re.search(r"sent \[(\d+), \1\]", out), out
    parameters, changed = map(int, re.search(r"parameters: (\d+) changed from the dummy weights: (\d+)", out).groups())
    assert 0 < changed <= parameters, out  # (a norm of ones is the same in the dummy weights)
    assert "every parameter as vLLM loads the checkpoint: True" in out, out
    assert re.search(r"same greedy completion: True [1-9]", out), out
    assert "watchdogs while serving: 1" in out and "group left: []" in out and "watchdogs left: []" in out, out


def test_a_torchrun_trainer_syncs_with_the_documented_calls(tmp_path, tiny_dense_checkpoint):
    """A user's trainer under torchrun, without Ray (tests/torchrun_rl.py), beside the copy table's first two rows
    alone: 2 gloo ranks, FSDP2, rank 0 starts the server on the checkpoint's real weights, and the ranks run the
    README's torchrun round through both loaders. On CPU the data plane goes through a file (no CUDA IPC, no
    sleep mode; see the file's docstring); the sources, their process-group calls, the direct loader's check and
    its learning on the server are the real ones. After every round vLLM holds the trainer's weights, bit for bit
    what vLLM's own loader makes of them, and the step changed them."""
    folder = copied(tmp_path / "my_rl", HELPERS + DIRECT)  # no Ray file: torchrun needs none
    shutil.copy(ROOT / "tests" / "torchrun_rl.py", folder)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["torchrun_rl.py", str(tiny_dense_checkpoint), json.dumps(CPU_LAUNCHER)]
    run = subprocess.run(argv, cwd=folder, env=alone(folder), capture_output=True, text=True, timeout=600)
    out = run.stdout
    print(out)
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    assert "process group: cpu:gloo,cuda:gloo | ranks: 2 |" in out, out
    flags = json.loads(out.split("serve flags: ", 1)[1].split("\n", 1)[0])
    assert "--load-format" not in flags and "weight_sync.direct_load.DirectLoadWorker" in flags, flags
    learned = json.loads(out.split("direct: the direct loader learned ", 1)[1].split("\n", 1)[0])
    assert learned["plain"] > 0, learned  # (on CPU, vLLM repacks some linear weights after a load: not learned)
    for loader in ("direct", "vllm"):
        for step in (1, 2):
            line = re.search(rf"{loader}: round {step}: vLLM holds the trainer's weights: (\w+) \((\d+) of (\d+)", out)
            assert line and line[1] == "True", out
            assert 0 < int(line[2]) <= int(line[3]), line[0]
    assert re.search(r"serves after the rounds: [1-9]", out) and "left: processes [] | its folder: False" in out, out


def test_what_a_user_reads_first_stays_one_sittings_read():
    """helpers.py, the file every path copies, at most 1,000 lines (ruff-formatted, as CI checks); the README at
    most 160."""
    assert len((ROOT / "helpers.py").read_text().splitlines()) <= 1000
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160
