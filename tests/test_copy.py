"""The README's copy table is true: each file it names imports with only the
files its last column names beside it, in an empty directory with nothing
else of this project on the path; and the lift runs a user's own RL code
there (tests/lifted_rl.py): its own trainer class as 2 Ray ranks, FSDP2,
the server started through the lift, the direct loader's check before a send."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import CPU_LAUNCHER, cpu_serve_args

ROOT = Path(__file__).resolve().parents[1]
LIFT = ["helpers.py", "weight_sync/sources.py"]
NOT_COPIED = ["rlhf_ipc_fsdp_ep.py", "proof/program.py", "proof/checks.py", "proof/exact_check_engine.py",
              "proof/toy_rl.py", "scripts/benchmark.py"]  # the rows that say "nothing"


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


def test_the_table_is_there():
    assert [files for files, _ in ROWS][0] == LIFT
    not_copied = sum((files for files, needs in ROWS if not needs and files[0] in NOT_COPIED), [])
    assert sorted(not_copied) == sorted(NOT_COPIED)


def test_helpers_imports_nothing_of_this_project(tmp_path):
    """helpers.py alone in an empty directory imports: whatever of this project it
    uses, it imports where it uses it (and says so), not when it is imported."""
    folder = copied(tmp_path / "alone", ["helpers.py"])
    run = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, '.'); import helpers"],
                         cwd=folder, capture_output=True, text=True, env=alone(folder), timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-1500:]


def test_each_row_imports_beside_only_what_it_names(tmp_path):
    runs = {}
    for k, (files, needs) in enumerate(r for r in ROWS if r[0][0] not in NOT_COPIED):
        folder = copied(tmp_path / f"row{k}", files + needs)
        code = "".join(f"import {f.removesuffix('.py').replace('/', '.')}\n" for f in files)
        code = f"import sys; sys.path.insert(0, '.')\n{code}"  # -I: no PYTHONPATH, no user site; this folder only
        runs[", ".join(files)] = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=folder,
                                                  stderr=subprocess.PIPE, text=True, env=alone(folder))  # fmt: skip
    failed = {row: run.communicate(timeout=240)[1][-1500:] for row, run in runs.items()}
    assert not {row: err for row, err in failed.items() if runs[row].returncode}, failed


def test_the_lift_runs_a_users_own_trainer(tmp_path, tiny_checkpoint):
    ((_, needs),) = [r for r in ROWS if r[0] == LIFT]
    folder = copied(tmp_path / "my_rl", LIFT + needs)
    shutil.copy(ROOT / "tests" / "lifted_rl.py", folder)
    lines = sum(len((folder / f).read_text().splitlines()) for f in LIFT + needs)
    print(f"the lift: {', '.join(LIFT + needs)}: {lines} lines")
    flags = cpu_serve_args(tiny_checkpoint, worker="weight_sync.direct_load.DirectLoadWorker")[1:]  # what the lift has
    argv = [sys.executable, "lifted_rl.py", str(tiny_checkpoint), json.dumps(flags), json.dumps(CPU_LAUNCHER)]
    run = subprocess.run(argv, cwd=folder, env=alone(folder),
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    assert "ranks [0, 1]" in out and "same names and shapes on every rank: True" in out
    blocks = json.loads(out.split("expert blocks: ", 1)[1].split("\n", 1)[0])
    assert blocks and all(shape[0] == 4 for shape in blocks.values()), blocks  # 8 experts: each rank its 4
    assert "one rank: passed" in out
    assert re.search(r"two ranks: refused: .*holds experts 0\.\.7 .* sends experts 0\.\.3", out), out
    assert "health: True" in out
