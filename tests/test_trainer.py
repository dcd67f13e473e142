# SPDX-License-Identifier: Apache-2.0
"""The trainer side on CPU: FSDP2 over 2 gloo processes, Ray placement, and the
logprob gate against a real vLLM server."""

import re
import shutil
import sys
import time

import pytest
import ray.cloudpickle
import torch

import helpers
import rlhf_ipc_fsdp_ep as script
from conftest import SERVED_NAME, listening_tcp, metrics_text, run_ranks
from proof import exact_check_driver, logprob_gate, rank_measurement
from weight_sync import generation, ray_trainers


def _gather_source(trainer, ckpt, random_init, out_dir, loader):
    from vllm.distributed.weight_transfer.base import ModuleSource

    trainer.build_model(str(ckpt))
    trainer.init_weights(str(ckpt), random_init=random_init, seed=3)
    source = ModuleSource(trainer.model) if loader == "module" else trainer.weight_source(loader)
    metadata = source.metadata() if callable(source.metadata) else source.metadata  # vLLM's own: 0.32 a method
    meta = [(m.name, m.dtype, tuple(m.shape)) for m in metadata]
    tensors = {name: t.detach().clone() for name, t in source}
    sync_bytes = rank_measurement.sync_bytes(trainer.model, source) if loader != "module" else None
    torch.save({"meta": meta, "tensors": tensors, "sync_bytes": sync_bytes}, out_dir / f"rank{trainer.rank}.pt")


def _run_two_ranks(ckpt, random_init, tmp_path, loader="module"):
    run_ranks(_gather_source, 2, ckpt, random_init, tmp_path, loader)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_module_source_over_fsdp2_yields_the_unsharded_checkpoint(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    ranks = _run_two_ranks(tiny_checkpoint, random_init=False, tmp_path=tmp_path)
    reference = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).named_parameters())
    for got in ranks:
        assert list(got["tensors"]) == list(reference)  # same names, same order
        assert [m[0] for m in got["meta"]] == list(reference)
        for name, ref in reference.items():
            t = got["tensors"][name]
            assert t.dtype == ref.dtype == torch.bfloat16, name
            assert t.shape == ref.shape, name
            assert torch.equal(t, ref), name


def test_vllm_loader_source_over_fsdp2_yields_what_save_pretrained_writes(tiny_checkpoint, tmp_path):
    """vLLM's own loader reads checkpoints: BF16Source yields exactly the
    checkpoint's tensors (per-expert names here), gathered from 2 FSDP ranks."""
    from safetensors.torch import load_file

    ranks = _run_two_ranks(tiny_checkpoint, random_init=False, tmp_path=tmp_path, loader="vllm")
    saved = load_file(next(tiny_checkpoint.glob("*.safetensors")))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in saved  # the checkpoint form, not the fused one
    for got in ranks:
        assert sorted(got["tensors"]) == sorted(saved) == sorted(m[0] for m in got["meta"])
        for name, t in got["tensors"].items():
            assert torch.equal(t, saved[name]), name


def _one_rank_source(trainer, ckpt, out_dir):
    """Both sources on one FSDP2 rank, fp32 masters (--train's), each FSDP
    module's unshard() counted (and still run, were it called)."""
    from torch.distributed.fsdp import FSDPModule

    trainer.build_model(str(ckpt), lr=1e-5)
    trainer.init_weights(str(ckpt), random_init=True, seed=3)
    unshards, unshard = [], FSDPModule.unshard
    FSDPModule.unshard = lambda module, *args, **kwargs: unshards.append(module) or unshard(module, *args, **kwargs)
    try:
        report = {
            loader: [(n, t.detach().clone()) for n, t in trainer.weight_source(loader).tensors()]
            for loader in ("vllm", "direct")
        }
    finally:
        FSDPModule.unshard = unshard
    report["unshards"] = len(unshards)
    report["model"] = {n: p.to_local().detach().clone() for n, p in trainer.model.named_parameters()}
    torch.save(report, out_dir / "rank0.pt")


def test_on_one_rank_the_sources_read_the_shards_as_they_are(tiny_checkpoint, tmp_path):
    """FSDP2 over one rank: each parameter's one shard is all of it, so the
    sources gather nothing (no unshard) and send the masters cast to bf16,
    the bits FSDP's own gather in bf16 would give."""
    run_ranks(_one_rank_source, 1, tiny_checkpoint, tmp_path)
    got = torch.load(tmp_path / "rank0.pt")
    assert got["unshards"] == 0
    direct = dict(got["direct"])
    same_names = [name for name in got["model"] if name in direct]
    assert sorted(same_names) == sorted(direct)  # every tensor is one parameter (qwen3_moe's experts are named so)
    for name in same_names:
        sent, master = direct[name], got["model"][name]
        assert sent.dtype == torch.bfloat16 and master.dtype == torch.float32, name
        assert torch.equal(sent, master.to(torch.bfloat16)), name
    assert len(got["vllm"]) > len(direct)  # vLLM's loader: one tensor per expert


def test_direct_loader_source_sends_each_rank_its_own_experts_and_the_rest_whole(tiny_checkpoint, tmp_path):
    """What the direct loader gets from FSDP2 rank r: experts [r*E/2, (r+1)*E/2)
    of each fused expert tensor (the block vLLM's linear expert placement gives
    the engine on rank r's GPU), everything else whole, in bf16; both ranks
    yield the same names and shapes, as vLLM's packed IPC producer requires.
    The bytes reported per GPU are exactly what the source yields."""
    from transformers import AutoModelForCausalLM

    ranks = _run_two_ranks(tiny_checkpoint, random_init=False, tmp_path=tmp_path, loader="direct")
    reference = dict(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).named_parameters())
    assert ranks[0]["meta"] == ranks[1]["meta"]
    experts = [n for n in reference if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(experts) == 4  # 2 layers x (gate_up, down)
    for rank, got in enumerate(ranks):
        assert sorted(got["tensors"]) == sorted(reference)  # Qwen3-MoE: the checkpoint keeps the other names
        assert list(got["tensors"]) == [m[0] for m in got["meta"]]
        for (name, dtype, shape), t in zip(got["meta"], got["tensors"].values(), strict=True):
            assert (t.dtype, tuple(t.shape)) == (dtype, shape) == (torch.bfloat16, shape), name
            ref = reference[name]
            if name in experts:
                half = ref.shape[0] // 2
                assert torch.equal(t, ref[rank * half : (rank + 1) * half]), name
            else:
                assert torch.equal(t, ref), name
        model_bytes = sum(r.numel() * 2 for r in reference.values())
        expert_bytes = sum(reference[n].numel() * 2 for n in experts)
        assert got["sync_bytes"] == {"model": model_bytes, "per_gpu": model_bytes - expert_bytes // 2}


def test_direct_loader_source_for_a_renamed_family(tmp_path):
    """Mixtral (experts under `block_sparse_moe` in its checkpoints, router
    renamed too) over 2 FSDP ranks: the rest in checkpoint form, each rank's
    expert blocks under the checkpoint's expert module, which is vLLM's
    expert layer name; same names and shapes on both ranks."""
    from weight_sync import models

    models.build_preset("tiny-mixtral", tmp_path / "model")
    run_ranks(_gather_source, 2, tmp_path / "model", True, tmp_path, "direct")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert rank0["meta"] == rank1["meta"]
    names = [m[0] for m in rank0["meta"]]
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not [n for n in names if ".mlp." in n]  # nothing under the in-memory name
    blocks = {m[0]: m[2] for m in rank0["meta"] if m[0].endswith(("gate_up_proj", "down_proj"))}
    assert sorted(blocks) == [
        f"model.layers.{i}.block_sparse_moe.experts.{t}" for i in (0, 1) for t in ("down_proj", "gate_up_proj")
    ]
    assert all(shape[0] == 4 for shape in blocks.values())  # 8 experts, 4 per rank
    name = "model.layers.1.block_sparse_moe.experts.gate_up_proj"
    assert not torch.equal(rank0["tensors"][name], rank1["tensors"][name])  # each rank its own experts


def _random_models(trainer, out_dir):
    models_by_seed = []
    for seed in (3, 3, 4):
        trainer.build_model(str(out_dir / "model"))
        trainer.init_weights(str(out_dir / "model"), random_init=True, seed=seed)
        local = trainer.model.model.layers[0].mlp.experts.gate_up_proj.to_local().clone()
        models_by_seed.append(({n: t.clone() for n, t in trainer.weight_source("vllm")}, local))
    torch.save(models_by_seed, out_dir / f"rank{trainer.rank}.pt")


def test_random_init_follows_the_seed_and_gives_each_rank_its_own_shard(tmp_path):
    """The same seed builds the same model, another seed another one; each
    rank draws its own shard (the halves differ, none is empty); norms are 1."""
    from weight_sync import models

    models.build_preset("tiny", tmp_path / "model")
    run_ranks(_random_models, 2, tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    (first, shard0), (again, _), (other, _) = rank0
    for name, t in first.items():
        assert torch.equal(t, again[name]), name  # same seed, same model
    differ = [name for name, t in first.items() if not torch.equal(t, other[name])]
    assert set(differ) == {n for n in first if "norm" not in n}  # another seed: every random tensor differs
    assert not torch.equal(shard0, rank1[0][1])  # each rank drew its own experts
    assert shard0.abs().sum() > 0 and rank1[0][1].abs().sum() > 0
    norm = first["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))


def test_trainers_are_placed_one_per_bundle_on_one_node(cpu_trainers):
    from ray.util.placement_group import placement_group_table

    placements = ray_trainers.placements(cpu_trainers)
    assert [p["rank"] for p in placements] == [0, 1]
    assert len({p["node"] for p in placements}) == 1
    assert all(p["gpu_ids"] == [] for p in placements)  # Ray reports what it gave: no GPUs here
    # One node is all this test cluster has, so ask Ray how it was told to place them:
    # CUDA IPC needs every rank on the same machine.
    groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
    assert {g["strategy"] for g in groups} == {"STRICT_PACK"}


def test_the_trainers_rendezvous_on_one_node_is_a_private_file_not_a_port(cpu_trainers):
    """On one node the ranks meet at a torch FileStore in a directory of its
    own (mode 0700, this user's), which no other user can enter: no rank
    listens on a TCP port for it, which any local user could connect to."""
    import os
    import stat

    def seen(trainer):
        from torch.distributed.distributed_c10d import _get_default_store

        return {
            "store": type(_get_default_store().underlying_store).__name__,
            "dir": os.path.dirname(ray_trainers._store.path) if ray_trainers._store else "",
            "pid": os.getpid(),
        }

    ranks = ray.get([t.__ray_call__.remote(seen) for t in cpu_trainers])
    assert [r["store"] for r in ranks] == ["FileStore", "FileStore"]  # what each rank's process group uses
    listening = [len(listening_tcp([r["pid"]])) for r in ranks]
    assert listening[0] == listening[1], listening  # rank 0 listens on nothing more than rank 1 (gloo's, Ray's)
    folder = os.stat(ranks[0]["dir"])
    assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid()
    assert os.listdir(ranks[0]["dir"]) == ["store"]


def test_opening_the_rendezvous_on_one_node_listens_on_no_port():
    import os
    import shutil

    before = set(listening_tcp([os.getpid()]))
    where = ray_trainers.open_rendezvous("127.0.0.1", 2)
    try:
        assert set(listening_tcp([os.getpid()])) == before
    finally:
        shutil.rmtree(os.path.dirname(where))


def test_server_calls_give_up_before_the_trainers_collectives_do():
    """A hung server must surface as a server error, not as a trainer rank
    timing out in a collective."""
    assert helpers.SERVER_CALL_TIMEOUT_S + 10 < ray_trainers.COLLECTIVE_TIMEOUT.total_seconds()


def test_too_few_gpus_is_a_clear_error(ray_cluster):
    with pytest.raises(ray_trainers.PlacementError, match="asked for 2 GPUs but the Ray cluster has 0"):
        script.start_trainers(script.FSDPTrainer, 2, gpus_per_trainer=1)


def test_unplaceable_trainers_time_out_with_the_reason(ray_cluster):
    start = time.monotonic()
    with pytest.raises(ray_trainers.PlacementError, match="could not place 16 trainers"):
        script.start_trainers(script.FSDPTrainer, 16, gpus_per_trainer=0, placement_timeout_s=2)
    assert time.monotonic() - start < 30


class TrainerThatCannotStart(script.FSDPTrainer):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import this module


def test_a_trainer_that_fails_to_start_says_why(ray_cluster, fresh_cpu_trainers):
    with pytest.raises(ray_trainers.TrainerDied, match=r"process died: .*CUDA out of memory\. Tried to allocate 20"):
        fresh_cpu_trainers(trainer_cls=TrainerThatCannotStart)


def test_ray_get_all_raises_at_the_first_failure(ray_cluster):
    """A failed rank must not leave the driver waiting on ranks stuck in a collective."""

    @ray_cluster.remote(num_cpus=0)
    def fails():
        raise ValueError("rank 0 died")

    @ray_cluster.remote(num_cpus=0)
    def hangs():
        time.sleep(120)

    stuck = hangs.remote()
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0 died"):
        script.ray_get_all([stuck, fails.remote()])
    assert time.monotonic() - start < 90  # not the 120 s of `hangs` (a loaded machine is slow to start workers)
    ray_cluster.cancel(stuck, force=True)


def test_a_trainer_rank_that_dies_mid_collective_surfaces_at_once(ray_cluster, fresh_cpu_trainers, tiny_checkpoint):
    """Rank 1 waits in FSDP's all-gather for rank 0, which dies: the driver must
    hear of it at once instead of waiting for the collective's timeout."""
    trainers = fresh_cpu_trainers()
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint)) for t in trainers])
    script.ray_get_all([t.init_weights.remote(str(tiny_checkpoint), True) for t in trainers])
    waiting = trainers[1].token_logprobs.remote([[5, 6, 7, 8]])  # blocks without rank 0
    start = time.monotonic()
    ray_cluster.kill(trainers[0])
    with pytest.raises(ray_trainers.TrainerDied, match="a trainer rank's process died"):
        script.ray_get_all([_call_on_a_killed_actor(ray_cluster, trainers[0]), waiting])
    assert time.monotonic() - start < 120  # not the collective's 10-minute timeout


def _call_on_a_killed_actor(ray_cluster, actor, timeout_s=60):
    """A call that reaches `actor` after its kill. ray.kill is asynchronous:
    a call sent right after it can still run (seen here once in ~8 runs), and
    then only the other rank's collective error would be left to report."""
    deadline = time.monotonic() + timeout_s
    while True:
        ref = actor.__ray_ready__.remote()
        try:
            ray_cluster.get(ref, timeout=timeout_s)
        except ray_cluster.exceptions.RayActorError:
            return ref
        if time.monotonic() > deadline:
            return ref


def test_each_rank_measures_its_devices_copy_rate(cpu_trainers):
    """The benchmark's floor: every rank copies a buffer on its own device and reports GB/s."""
    rates = script.ray_get_all(
        [t.__ray_call__.remote(rank_measurement.device_copy_gb_per_s, 8 * 1024**2, 3) for t in cpu_trainers]
    )
    assert len(rates) == 2 and all(0.05 < r < 10_000 for r in rates), rates


def test_the_benchmark_times_each_of_a_syncs_calls_alone_and_leaves_vllm_serving(cpu_server, cpu_trainers):
    """The benchmark's floor for a sync's calls (benchmark.control_plane_seconds): vLLM's pause, an empty Ray
    call into every rank, an empty call into every engine, and the resume, each timed alone, as often as asked,
    their medians returned for the JSON; vLLM is awake and serving afterwards."""
    from types import SimpleNamespace

    from scripts import benchmark

    def pauses_and_resumes() -> list[float]:  # vLLM's own count of each, from its metrics
        text = metrics_text(cpu_server.socket_path)
        pattern = r'vllm:sleep_mode_operation_duration_seconds_count\{operation="%s"\} (\S+)'
        return [float((re.findall(pattern % op, text) or [0])[0]) for op in ("sleep", "wake")]

    before = pauses_and_resumes()
    got = benchmark.control_plane_seconds(SimpleNamespace(server=cpu_server, trainers=cpu_trainers), repeats=3)
    parts = ["sleep", "ray_call", "server_call", "wake"]
    assert list(got) == [*parts, "total", "repeats"] and got["repeats"] == 3 and all(got[p] > 0 for p in parts)
    assert got["total"] == pytest.approx(sum(got[p] for p in parts))
    assert pauses_and_resumes() == [before[0] + 3, before[1] + 3]
    assert not helpers.is_sleeping(cpu_server.socket_path)
    assert generation.completions(cpu_server.socket_path, SERVED_NAME, ["a"], 2)[0].token_ids


def test_logprob_gate_passes_on_equal_weights_and_fails_on_other_weights(cpu_server, cpu_trainers, tiny_checkpoint):
    sock = cpu_server.socket_path
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint)) for t in cpu_trainers])
    script.ray_get_all([t.init_weights.remote(str(tiny_checkpoint), False) for t in cpu_trainers])
    outs = generation.completions(sock, SERVED_NAME, ["The capital of France is", "Hello"], max_tokens=8)
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]

    # The trainer's own kernel noise: a second forward through the other
    # attention implementation, then the first one back for every later forward.
    reference = logprob_gate.trainer_logprobs(cpu_trainers, sequences)
    kernel = logprob_gate.kernel_noise(cpu_trainers, sequences)
    assert kernel.attention == "sdpa vs eager" and 0 < kernel.mean < 0.01, kernel
    assert logprob_gate.trainer_logprobs(cpu_trainers, sequences) == reference
    # --rollout-dtype fp8: one more forward with each rank's experts as vLLM serves them in FP8; what
    # FP8 alone moves is larger than the kernels' noise, and the weights are put back bit for bit.
    held = [
        t.__ray_call__.remote(lambda t: rank_measurement.parameter_fingerprints(t.model.parameters()))
        for t in cpu_trainers
    ]
    held = script.ray_get_all(held)
    fp8 = logprob_gate.kernel_noise(cpu_trainers, sequences, fp8=True)
    assert fp8.fp8_mean > kernel.mean and fp8.fp8_quantile > 0 and fp8.bound_mean > fp8.mean, fp8
    assert (
        script.ray_get_all(
            [
                t.__ray_call__.remote(lambda t: rank_measurement.parameter_fingerprints(t.model.parameters()))
                for t in cpu_trainers
            ]
        )
        == held
    )
    assert logprob_gate.trainer_logprobs(cpu_trainers, sequences) == reference
    tolerances = logprob_gate.Tolerances.from_args(script.parse_args([]), kernel)
    assert tolerances.given(None) == (tolerances.mean, tolerances.quantile)  # a small noise widens nothing
    same = logprob_gate.logprob_gap(
        sock, SERVED_NAME, logprob_gate.trainer_logprobs(cpu_trainers, sequences), sequences, 1
    )
    assert same.mean <= tolerances.mean and same.quantile <= tolerances.quantile, same
    # The noise, measured on these identical weights, widens nothing here.
    assert tolerances.given(same) == (tolerances.mean, tolerances.quantile)

    try:
        # The trainer now holds other weights: the server is "stale" and the gate must say so.
        script.ray_get_all([t.build_model.remote(str(tiny_checkpoint)) for t in cpu_trainers])
        script.ray_get_all([t.init_weights.remote(str(tiny_checkpoint), True, 7) for t in cpu_trainers])
        stale = logprob_gate.logprob_gap(
            sock, SERVED_NAME, logprob_gate.trainer_logprobs(cpu_trainers, sequences), sequences, 1
        )
        assert stale.mean > 3 * tolerances.mean and stale.quantile > tolerances.quantile, stale
        assert logprob_gate.gate(same, stale, tolerances, weights_updated=True, noise=same).passed is False
        # Seen as a training step that the engine did not follow: with tolerances too wide to see anything,
        # the change test alone fails the round, naming the engine.
        wide = logprob_gate.Tolerances(10.0, 10.0, None, 2.0, kernel)
        step = logprob_gate.gate(same, stale, wide, weights_updated=False, noise=same, stepped=True)
        assert step.change.gated and step.change.verdict == "did not follow" and not step.passed, step.change
        assert step.change.worst_dp_rank == 0 and step.change.trainer_change_mean > 10 * step.change.noise_mean
    finally:  # the shared trainers hold the checkpoint again, as the other tests expect
        script.ray_get_all([t.build_model.remote(str(tiny_checkpoint)) for t in cpu_trainers])
        script.ray_get_all([t.init_weights.remote(str(tiny_checkpoint), False) for t in cpu_trainers])


def test_fp8_activations_are_vllms_per_token_group_quantization():
    """The gate's FP8 basis reads the experts' activations as vLLM's block-FP8
    MoE kernel does: each row in groups of 128 columns (the last padded),
    quantized to e4m3 and back; the same values as vLLM's own QuantFP8
    (dynamic, groups of 1 x 128) dequantized."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):
        quant = QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False)
    x = torch.randn(37, 320, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 320)
    x = x.to(torch.bfloat16)
    values, scales = quant.forward_native(x)
    padded = torch.nn.functional.pad(values.float(), (0, 3 * 128 - 320)).unflatten(-1, (3, 128))
    assert torch.equal(logprob_gate.fp8_activations(x), (padded * scales[..., None]).flatten(-2)[..., :320].to(x.dtype))


FP8_FAMILIES = {  # the families --rollout-dtype fp8 takes: their experts module, and its size's names
    "qwen3_moe": ("Qwen3MoeExperts", {"moe_intermediate_size": 64, "num_experts": 4}),
    "qwen2_moe": ("Qwen2MoeExperts", {"moe_intermediate_size": 64, "num_experts": 4}),
    "deepseek_v3": ("DeepseekV3Experts", {"moe_intermediate_size": 64, "n_routed_experts": 4}),
    "glm4_moe": ("Glm4MoeExperts", {"moe_intermediate_size": 64, "n_routed_experts": 4}),
    "mixtral": ("MixtralExperts", {"intermediate_size": 64, "num_local_experts": 4}),
}


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_the_fp8_experts_forward_is_the_experts_own_with_their_activations_quantized(family):
    """fp8_experts_forward, which stands in for a fused experts module's
    forward while the gate's FP8 basis is measured: with activations left
    as they are, the module's own output, in every family FP8 takes; it
    quantizes each expert's input and its intermediate (act(gate) x up),
    nothing else."""
    import importlib

    from transformers import AutoConfig

    class_name, sizes = FP8_FAMILIES[family]
    config = AutoConfig.for_model(family, hidden_size=256, num_experts_per_tok=2, **sizes)
    config._experts_implementation = "eager"
    generator = torch.Generator().manual_seed(0)
    experts = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), class_name)(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    hidden = torch.randn(9, 256, generator=generator)
    top_k_index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(9)])
    top_k_weights = torch.rand(9, 2, generator=generator)
    read = []

    def as_read(x):
        read.append(tuple(x.shape))
        return x

    own = experts(hidden, top_k_index, top_k_weights)
    torch.testing.assert_close(
        logprob_gate.fp8_experts_forward(experts, as_read)(hidden, top_k_index, top_k_weights), own
    )
    used = top_k_index.unique().tolist()
    assert sorted(read) == sorted(
        [(int((top_k_index == e).sum()), 256) for e in used] + [(int((top_k_index == e).sum()), 64) for e in used]
    )
    quantized = logprob_gate.fp8_experts_forward(experts)(hidden, top_k_index, top_k_weights)
    assert not torch.equal(quantized, own) and (quantized - own).abs().max() < 0.1 * own.abs().max()


SAMPLES = [
    {"prompt_ids": [5, 17, 99], "completion_ids": [300, 42, 7, 8], "advantage": 0.5},
    {"prompt_ids": [11, 12], "completion_ids": [13, 14, 15], "advantage": -0.25},
    {"prompt_ids": [200, 201, 202, 203], "completion_ids": [2], "advantage": -0.25},
]


def _full_bf16(trainer):
    return {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}


def _train_once(trainer, ckpt, out_dir, forward_first):
    trainer.build_model(str(ckpt), lr=1e-2)
    trainer.init_weights(str(ckpt), random_init=False)
    trainer.optimizer = rank_measurement.StepWatch(
        trainer.optimizer, trainer.model, trainer.device
    )  # as rank_measurement.measure does
    if forward_first:  # as every round does: the gate's forward pass comes before the step
        trainer.token_logprobs([[5, 6, 7, 8]])
    before = _full_bf16(trainer)
    loss = trainer.train_step(SAMPLES)
    after = _full_bf16(trainer)
    source = trainer.weight_source("vllm")  # what vLLM's loader receives: bf16 of the fp32 masters
    meta = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata]
    sent = {name: t.clone() for name, t in source}
    masters = {name: p.full_tensor().detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save(
        {
            "loss": loss,
            "meta": meta,
            "sent": sent,
            "before": before,
            "after": after,
            "masters": masters,
            "unchanged_by_step": trainer.optimizer.unchanged,
        },
        out_dir / f"w{trainer.world_size}r{trainer.rank}.pt",
    )


def test_train_step_after_a_forward_moves_every_weight_that_vllm_receives(tiny_checkpoint, tmp_path):
    """The RL loop's order: the gate's forward pass, then the step. Every
    parameter must move, the root's own (embeddings, final norm, lm_head)
    included: FSDP2 leaves those unsharded after a forward, and an optimizer
    built then would never update them."""
    run_ranks(_train_once, 2, tiny_checkpoint, tmp_path, True)
    run_ranks(_train_once, 1, tiny_checkpoint, tmp_path, False)
    two, one = torch.load(tmp_path / "w2r0.pt"), torch.load(tmp_path / "w1r0.pt")

    # The batch split over 2 ranks is the same step as the whole batch on 1.
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    assert two["loss"] != 0
    assert two["unchanged_by_step"] == [] and one["unchanged_by_step"] == []
    unchanged = [n for n in two["before"] if torch.equal(two["before"][n], two["after"][n])]
    assert unchanged == []
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(two["after"])
    for name, master in two["masters"].items():
        assert master.dtype == torch.float32, name  # fp32 master weights while training
    # vLLM receives bf16, in checkpoint form (per-expert tensors here), and the metadata says so.
    assert [m[0] for m in two["meta"]] == list(two["sent"])
    for name, dtype, shape in two["meta"]:
        assert (dtype, shape) == (two["sent"][name].dtype, tuple(two["sent"][name].shape)) == (torch.bfloat16, shape), (
            name
        )
    experts = two["masters"]["model.layers.1.mlp.experts.down_proj"]
    assert torch.equal(two["sent"]["model.layers.1.mlp.experts.3.down_proj.weight"], experts[3].to(torch.bfloat16))
    assert torch.equal(two["sent"]["lm_head.weight"], two["masters"]["lm_head.weight"].to(torch.bfloat16))


def _step_without_gradients(trainer, ckpt, out_dir):
    trainer.build_model(str(ckpt), lr=1e-2)
    trainer.init_weights(str(ckpt), random_init=False)
    trainer.model.lm_head.weight.requires_grad_(False)  # a parameter the step cannot move
    trainer.optimizer = rank_measurement.StepWatch(
        trainer.optimizer, trainer.model, trainer.device
    )  # as rank_measurement.measure does
    trainer.train_step(SAMPLES)
    torch.save(trainer.optimizer.unchanged, out_dir / f"unchanged{trainer.rank}.pt")


def test_a_parameter_the_step_did_not_move_is_named(tiny_checkpoint, tmp_path):
    run_ranks(_step_without_gradients, 2, tiny_checkpoint, tmp_path)
    assert torch.load(tmp_path / "unchanged0.pt") == ["lm_head.weight"]


# Placement groups left behind. Asked of Ray itself after each failure, and not
# through fresh_cpu_trainers, which removes whatever group a test left.


def _groups_not_removed() -> dict[str, dict]:
    from ray.util.placement_group import placement_group_table

    return {group_id: g for group_id, g in placement_group_table().items() if g["state"] != "REMOVED"}


def _groups_left_since(before: set[str], timeout_s: float = 30) -> list[dict]:
    """The groups created since `before` and not removed; waits up to
    `timeout_s` for a removal Ray has not finished."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [g for group_id, g in _groups_not_removed().items() if group_id not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _remove_groups_left_since(before: set[str]) -> None:
    """So that a leak fails its own test only, not the next ones for want of CPUs."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for group_id in set(_groups_not_removed()) - before:
        remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))


# Ranks without the trainer (whose workers would import vLLM, for ~10 s on 2 cores):
# these tests need no model.
class RankThatCannotStart:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory (simulated)")


class NoModelRank:
    """A trainer rank of a class with nothing of ours: start_trainers joins it to the others."""


def _fails_once_placed(_trainer):
    raise RuntimeError("simulated failure once the trainers are placed")


def test_a_job_that_fails_after_placing_its_trainers_removes_its_placement_group(ray_cluster, monkeypatch):
    """In a Ray the job did not start (leave_ray then removes its group, and
    with it the trainers, rather than shutting Ray down): the job fails on
    its first call to the placed trainers, after start_trainers returned."""
    start_trainers, placed = script.start_trainers, []

    def on_cpu(*args, **kwargs):
        trainers, group = start_trainers(*args, **{**kwargs, "gpus_per_trainer": 0})
        placed.append(group.id.hex())
        return trainers, group

    monkeypatch.setattr(script, "start_trainers", on_cpu)
    monkeypatch.setattr(script, "RLTrainer", NoModelRank)
    monkeypatch.setattr(
        script,
        "placements",
        lambda trainers: script.ray_get_all([t.__ray_call__.remote(_fails_once_placed) for t in trainers]),
    )  # the first call to the placed trainers
    before = set(_groups_not_removed())
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="simulated failure once the trainers are placed"):
            with script.colocated_job(script.parse_args(["--model", "tiny", "--num-gpus", "2"])):
                pass
        assert ray.is_initialized()
        assert len(placed) == 1  # the group existed before the failure
        assert _groups_left_since(before) == []
    finally:
        _remove_groups_left_since(before)


def test_trainers_that_cannot_be_placed_leave_no_placement_group(ray_cluster):
    """start_trainers gives up waiting for a group Ray cannot place: the
    group, still pending, is removed (Ray would place it later otherwise,
    taking the GPUs of whatever runs next)."""
    before = set(_groups_not_removed())
    try:
        with pytest.raises(ray_trainers.PlacementError, match="could not place 16 trainers"):
            script.start_trainers(script.FSDPTrainer, 16, gpus_per_trainer=0, placement_timeout_s=1)
        assert _groups_left_since(before) == []
    finally:
        _remove_groups_left_since(before)


def test_a_trainer_that_fails_to_start_leaves_no_placement_group(ray_cluster):
    """A rank that dies in its constructor (CUDA out of memory): start_trainers
    raises before it returns the group, so no caller can remove it."""
    before = set(_groups_not_removed())
    try:
        with pytest.raises(ray_trainers.TrainerDied, match="CUDA out of memory"):
            script.start_trainers(RankThatCannotStart, 1, gpus_per_trainer=0)
        assert _groups_left_since(before) == []
    finally:
        _remove_groups_left_since(before)


def _open_as_another_user(path, flags, uid=65534):
    """errno of opening `path` with `flags` as user `uid` (0 if it opened)."""
    import os

    from conftest import as_another_user

    return as_another_user(lambda: os.close(os.open(path, flags, 0o666)), uid)


def test_another_user_cannot_read_write_or_plant_the_trainers_rendezvous(cpu_trainers):
    """User `nobody` can neither open the store file the ranks meet at (as
    torch's FileStore does: read-write, created if missing) nor read it, nor
    create a file beside it."""
    import errno
    import os

    path = ray.get(cpu_trainers[0].__ray_call__.remote(lambda _: ray_trainers._store.path))
    assert os.path.exists(path)
    assert _open_as_another_user(path, os.O_RDWR | os.O_CREAT) == errno.EACCES
    assert _open_as_another_user(path, os.O_RDONLY) == errno.EACCES
    assert _open_as_another_user(os.path.join(os.path.dirname(path), "planted"), os.O_RDWR | os.O_CREAT) == errno.EACCES
    assert _open_as_another_user(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY) == errno.EACCES  # no listing


def test_the_one_node_rendezvous_directory_goes_with_the_trainers(ray_cluster):
    """leave_ray removes it with the placement group (the ranks, killed, cannot)."""
    import os

    trainers, pg = script.start_trainers(NoModelRank, 2, gpus_per_trainer=0)
    store = ray.get(trainers[0].__ray_call__.remote(lambda _: ray_trainers._store.path))
    folder = os.path.dirname(store)
    assert os.path.isdir(folder)
    ray_trainers.leave_ray(False, pg)
    assert not os.path.exists(folder)


def test_a_trainer_that_is_a_ray_actor_already_starts_as_it_is(fresh_cpu_trainers):
    """start_trainers takes a class, or one a user made a Ray actor already
    (`@ray.remote class Trainer`, as in vLLM's example), whose ranks then
    join one process group the same way."""
    trainers = fresh_cpu_trainers(trainer_cls=ray.remote(script.FSDPTrainer))
    placements = ray_trainers.placements(trainers)
    assert [p["rank"] for p in placements] == [0, 1]


class SlowToFingerprint:  # a trainer rank whose measurement (rank_measurement.RankMeasurement) is slow to fingerprint
    def __init__(self, seconds: float = 2) -> None:
        self.measurement, self.seconds = self, seconds

    def start_sent_fingerprints(self) -> None:
        time.sleep(self.seconds)


def _check_job(trainers, socket_path="/nonexistent/vllm.sock"):
    from types import SimpleNamespace

    # Import what the check's calls run in a rank, as a real rank has, so that they answer at once.
    ray.get([t.__ray_call__.remote(lambda _: __import__("proof.rank_measurement")) for t in trainers])
    return SimpleNamespace(
        trainers=trainers,
        gpu_uuids=[""] * len(trainers),
        dp_size=1,
        server=SimpleNamespace(socket_path=str(socket_path)),
    )


def test_an_exact_check_left_running_by_a_failed_round_ends_before_the_job_leaves_ray(ray_cluster):
    """The exact check runs in a thread beside the gate; if the round fails
    before taking its verdict, the job's cleanup waits for it
    (exact_check_driver.settle_exact_checks) before it stops Ray under it."""
    from types import SimpleNamespace

    job = SimpleNamespace(
        trainers=[ray.remote(SlowToFingerprint).remote()],
        gpu_uuids=[""],
        dp_size=1,
        server=SimpleNamespace(socket_path="/nonexistent/vllm.sock"),
    )
    ray.get(job.trainers[0].__ray_ready__.remote())
    begin = time.monotonic()  # before the check starts: its 2 s then surely fall after `begin`
    started = exact_check_driver.start_exact_check(job)
    exact_check_driver.settle_exact_checks()
    assert started.done() and time.monotonic() - begin > 1
    with pytest.raises(helpers.ServerError):  # no server there: the verdict is that error
        exact_check_driver.exact_check(started)
    ray.kill(job.trainers[0])


def test_a_hung_trainer_rank_fails_the_exact_check_by_name_and_the_cleanup_waits_for_it(ray_cluster):
    """Rank 1 of two never answers: the check gives up after its call timeout, naming the rank, and the
    job's cleanup (settle_exact_checks) waits until the check has ended, however long its calls may take."""
    trainers = [ray.remote(SlowToFingerprint).remote(0), ray.remote(SlowToFingerprint).remote(600)]
    try:
        started = exact_check_driver.start_exact_check(_check_job(trainers), call_timeout_s=4)
        exact_check_driver.settle_exact_checks()
        assert started.done()
        verdict = exact_check_driver.exact_check(started)
        assert (
            not verdict.passed and verdict.problem == "trainer rank 1 did not answer start_sent_fingerprints within 4 s"
        )
    finally:
        for t in trainers:
            ray.kill(t)


def test_engines_that_do_not_answer_fail_the_exact_check_in_time(ray_cluster, tmp_path):
    """A server that takes the exact check's call and never answers: the check fails after the call's
    timeout (the server's own, plus 10 s for HTTP), naming the call and the engines, and its thread's
    connection is closed."""
    import socket
    import tempfile

    folder = tempfile.mkdtemp(prefix="hung-")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock := f"{folder}/vllm.sock")
    listener.listen()
    trainers = [ray.remote(SlowToFingerprint).remote(0)]
    try:
        begin = time.monotonic()
        started = exact_check_driver.start_exact_check(_check_job(trainers, sock), call_timeout_s=1)
        verdict = exact_check_driver.exact_check(started)
        assert time.monotonic() - begin < 60 and not verdict.passed
        assert verdict.problem.startswith("the DP engines (0-0) did not answer exact_check_start within 1 s"), verdict
        assert not [key for key in helpers._connections if key[2] == sock]
    finally:
        ray.kill(trainers[0])
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)
