"""The README's copy table is true: each file it names imports with only the
files its last column names beside it, in an empty directory with nothing
else of this project on the path; and the classes it says to copy out of the
script use nothing but the files their row names."""

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_ipc_fsdp_ep as script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_ROW = ["rlhf_ipc_fsdp_ep.py"]
NOT_COPIED = ["checks.py", "toy_rl.py", "benchmark.py"]  # the row that says "nothing"


def copy_table() -> list[tuple[list[str], list[str]]]:
    """(the files of a row, the files it needs beside them), per row of the table."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Copy it into your RL code") :].split("\n## ", 1)[0]
    py, rows = re.compile(r"`([a-z_]+\.py)`"), []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((py.findall(cells[0]), py.findall(cells[2])))
    return rows


ROWS = copy_table()


def start_import(folder: Path, modules: list[str], files: list[str]) -> subprocess.Popen:
    """Copy `files` into `folder` and import `modules` there, with nothing else of this project on the path."""
    folder.mkdir(exist_ok=True)
    for f in files:
        shutil.copy(ROOT / f, folder / f)
    code = f"import sys\nsys.path[0] = {str(folder)!r}\n" + "".join(f"import {m}\n" for m in modules)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=folder, stderr=subprocess.PIPE, text=True, env=env)


def test_the_table_is_there():
    assert SCRIPT_ROW in [files for files, _ in ROWS] and NOT_COPIED in [files for files, _ in ROWS]
    assert any(files == ["helpers.py"] for files, _ in ROWS)


def test_each_row_imports_beside_only_what_it_names(tmp_path):
    """Every row at once (each in its own folder), and the classes to copy out
    of the script as a module of their own."""
    ((_, needs),) = [r for r in ROWS if r[0] == SCRIPT_ROW]
    source = "\n\n".join(inspect.getsource(c) for c in (script.FSDPTrainer, script.BF16Source, script.LocalExpertSource))
    assert not re.search(r"\b(checks|toy_rl)\.", source)  # the proof and the toy RL stay behind
    header = ("from __future__ import annotations\n\nimport torch\n"
              "from vllm.distributed.weight_transfer.base import ParamMeta\n\n"
              "import helpers\nimport models\nimport weight_names\nfrom ray_ranks import Rank\n"
              "from vllm_compat import TrainerSource, vllm_load_form\n")  # fmt: skip
    (tmp_path / "lifted").mkdir()
    (tmp_path / "lifted" / "lifted.py").write_text(f"{header}\n\n{source}\n")
    runs = {"the classes copied out of the script": start_import(tmp_path / "lifted", ["lifted"], needs)}
    for k, (files, row_needs) in enumerate(r for r in ROWS if r[0] not in (SCRIPT_ROW, NOT_COPIED)):
        runs[", ".join(files)] = start_import(tmp_path / f"row{k}", [f.removesuffix(".py") for f in files], files + row_needs)
    failed = {row: run.communicate(timeout=240)[1][-1500:] for row, run in runs.items()}
    assert not {row: err for row, err in failed.items() if runs[row].returncode}, failed
