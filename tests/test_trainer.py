"""The trainer side on CPU: FSDP2 over 2 gloo processes, Ray placement, and the
logprob gate against a real vLLM server."""

import time

import pytest
import torch
import torch.multiprocessing as mp

import helpers
import rlhf_ipc_fsdp_ep as script
from conftest import SERVED_NAME


def _gather_source(rank, world_size, port, ckpt, random_init, out_dir, loader):
    from vllm.distributed.weight_transfer.base import ModuleSource

    trainer = script.FSDPTrainer(rank, world_size, port, device_type="cpu")
    trainer.build_model(str(ckpt), random_init=random_init, seed=3)
    source = ModuleSource(trainer.model) if loader == "module" else trainer.weight_source(loader)
    meta = [(m.name, m.dtype, tuple(m.shape)) for m in source.metadata()]
    tensors = {name: t.detach().clone() for name, t in source}
    torch.save({"meta": meta, "tensors": tensors}, out_dir / f"rank{rank}.pt")


def _run_two_ranks(ckpt, random_init, tmp_path, loader="module"):
    mp.spawn(
        _gather_source,
        args=(2, helpers.free_port(), ckpt, random_init, tmp_path, loader),
        nprocs=2,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


def test_module_source_over_fsdp2_yields_the_unsharded_checkpoint(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    ranks = _run_two_ranks(tiny_checkpoint, random_init=False, tmp_path=tmp_path)
    reference = dict(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).named_parameters()
    )
    for got in ranks:
        assert list(got["tensors"]) == list(reference)  # same names, same order
        assert [m[0] for m in got["meta"]] == list(reference)
        for name, ref in reference.items():
            t = got["tensors"][name]
            assert t.dtype == ref.dtype == torch.bfloat16, name
            assert t.shape == ref.shape, name
            assert torch.equal(t, ref), name


def test_direct_loader_source_sends_each_rank_its_own_experts_and_the_rest_whole(tiny_checkpoint, tmp_path):
    """What the direct loader gets from FSDP2 rank r: experts [r*E/2, (r+1)*E/2)
    of each fused expert tensor (the block vLLM's linear expert placement gives
    the engine on rank r's GPU), everything else whole, in bf16; both ranks
    yield the same names and shapes, as vLLM's packed IPC producer requires."""
    from transformers import AutoModelForCausalLM

    ranks = _run_two_ranks(tiny_checkpoint, random_init=False, tmp_path=tmp_path, loader="direct")
    reference = dict(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).named_parameters()
    )
    assert ranks[0]["meta"] == ranks[1]["meta"]
    experts = [n for n in reference if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(experts) == 4  # 2 layers x (gate_up, down)
    for rank, got in enumerate(ranks):
        assert list(got["tensors"]) == list(reference) == [m[0] for m in got["meta"]]
        for (name, dtype, shape), t in zip(got["meta"], got["tensors"].values(), strict=True):
            assert (t.dtype, tuple(t.shape)) == (dtype, shape) == (torch.bfloat16, shape), name
            ref = reference[name]
            if name in experts:
                half = ref.shape[0] // 2
                assert torch.equal(t, ref[rank * half : (rank + 1) * half]), name
            else:
                assert torch.equal(t, ref), name


def test_random_init_is_one_model_across_ranks(tiny_checkpoint, tmp_path):
    rank0, rank1 = _run_two_ranks(tiny_checkpoint, random_init=True, tmp_path=tmp_path)
    for name, t in rank0["tensors"].items():
        assert torch.equal(t, rank1["tensors"][name]), name
    experts = rank0["tensors"]["model.layers.0.mlp.experts.gate_up_proj"]
    # Each rank drew its own shard: the halves differ, none is left empty.
    assert not torch.equal(experts[:4], experts[4:])
    assert experts[:4].abs().sum() > 0 and experts[4:].abs().sum() > 0
    assert torch.equal(
        rank0["tensors"]["model.norm.weight"], torch.ones_like(rank0["tensors"]["model.norm.weight"])
    )


def test_trainers_are_placed_one_per_bundle_on_one_node(cpu_trainers):
    placements = script.ray_get_all([t.placement.remote() for t in cpu_trainers])
    assert [p["rank"] for p in placements] == [0, 1]
    assert len({p["node"] for p in placements}) == 1
    assert all(p["gpu_ids"] == [] for p in placements)  # Ray reports what it gave: no GPUs here


def test_too_few_gpus_is_a_clear_error(ray_cluster):
    with pytest.raises(script.PlacementError, match="asked for 2 GPUs but the Ray cluster has 0"):
        script.start_trainers(2, gpus_per_trainer=1, device_type="cpu")


def test_unplaceable_trainers_time_out_with_the_reason(ray_cluster):
    start = time.monotonic()
    with pytest.raises(script.PlacementError, match="could not place 16 trainers"):
        script.start_trainers(16, gpus_per_trainer=0, device_type="cpu", placement_timeout_s=2)
    assert time.monotonic() - start < 30


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
    assert time.monotonic() - start < 30
    ray_cluster.cancel(stuck, force=True)


def test_a_trainer_rank_that_dies_mid_collective_surfaces_at_once(
    ray_cluster, fresh_cpu_trainers, tiny_checkpoint
):
    """Rank 1 waits in FSDP's all-gather for rank 0, which dies: the driver must
    hear of it at once instead of waiting for the collective's timeout."""
    trainers = fresh_cpu_trainers()
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint), True) for t in trainers])
    waiting = trainers[1].prompt_logprobs.remote([[5, 6, 7, 8]])  # blocks without rank 0
    start = time.monotonic()
    ray_cluster.kill(trainers[0])
    with pytest.raises(script.TrainerDied, match="a trainer rank's process died"):
        script.ray_get_all([_call_on_a_killed_actor(ray_cluster, trainers[0]), waiting])
    assert time.monotonic() - start < 30


def _call_on_a_killed_actor(ray_cluster, actor, timeout_s=30):
    """A call that reaches `actor` after its kill. ray.kill is asynchronous:
    a call sent right after it can still run (seen here once in ~8 runs), and
    then only the other rank's collective error would be left to report."""
    deadline = time.monotonic() + timeout_s
    while True:
        ref = actor.placement.remote()
        try:
            ray_cluster.get(ref, timeout=timeout_s)
        except ray_cluster.exceptions.RayActorError:
            return ref
        if time.monotonic() > deadline:
            return ref


def test_logprob_gate_passes_on_equal_weights_and_fails_on_other_weights(
    cpu_server, cpu_trainers, tiny_checkpoint
):
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint), False) for t in cpu_trainers])
    outs = helpers.completions(
        cpu_server.url, SERVED_NAME, ["The capital of France is", "Hello"], max_tokens=8
    )
    sequences = [o.prompt_token_ids + o.token_ids for o in outs]

    defaults = script.parse_args([])
    tolerances = {"mean": defaults.logprob_mean_tolerance, "max": defaults.logprob_max_tolerance}
    same = script.logprob_gap(cpu_server.url, SERVED_NAME, cpu_trainers, sequences, dp_size=1)
    assert same["mean_abs"] <= tolerances["mean"] and same["max_abs"] <= tolerances["max"], same

    # The trainer now holds other weights: the server is "stale" and the gate must say so.
    script.ray_get_all([t.build_model.remote(str(tiny_checkpoint), True, 7) for t in cpu_trainers])
    stale = script.logprob_gap(cpu_server.url, SERVED_NAME, cpu_trainers, sequences, dp_size=1)
    assert stale["mean_abs"] > 3 * tolerances["mean"] and stale["max_abs"] > tolerances["max"], stale
    sync = script.Sync({p: 1.0 for p in helpers.SYNC_PHASES}, send_per_rank=[])
    record = script.round_record(sync, 10**9, same, stale, tolerances, memory=[], weights_updated=True)
    assert record["gate_passed"] is False


SAMPLES = [
    {"prompt_ids": [5, 17, 99], "completion_ids": [300, 42, 7, 8], "advantage": 0.5},
    {"prompt_ids": [11, 12], "completion_ids": [13, 14, 15], "advantage": -0.25},
    {"prompt_ids": [200, 201, 202, 203], "completion_ids": [2], "advantage": -0.25},
]


def _train_once(rank, world_size, port, ckpt, out_dir):
    trainer = script.FSDPTrainer(rank, world_size, port, device_type="cpu")
    trainer.build_model(str(ckpt), random_init=False, trainable=True)
    before = {name: t.clone() for name, t in trainer.weight_source()}
    loss = trainer.train_step(SAMPLES, lr=1e-2)
    after = {name: t.clone() for name, t in trainer.weight_source()}
    masters = {name: p.full_tensor().detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save(
        {"loss": loss, "before": before, "after": after, "masters": masters},
        out_dir / f"w{world_size}r{rank}.pt",
    )


def test_train_step_on_fsdp2_moves_the_weights_that_vllm_receives(tiny_checkpoint, tmp_path):
    port = helpers.free_port()
    mp.spawn(_train_once, args=(2, port, tiny_checkpoint, tmp_path), nprocs=2, join=True)
    mp.spawn(_train_once, args=(1, helpers.free_port(), tiny_checkpoint, tmp_path), nprocs=1, join=True)
    two, one = torch.load(tmp_path / "w2r0.pt"), torch.load(tmp_path / "w1r0.pt")

    # The batch split over 2 ranks is the same step as the whole batch on 1.
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-3)
    assert two["loss"] != 0
    for name, master in two["masters"].items():
        assert master.dtype == torch.float32, name  # fp32 master weights while training
        sent = two["after"][name]
        assert sent.dtype == torch.bfloat16, name  # vLLM gets bf16
        assert torch.equal(sent, master.to(torch.bfloat16)), name
    changed = [n for n in two["before"] if not torch.equal(two["before"][n], two["after"][n])]
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.gate.weight",
    ):
        assert name in changed
