# SPDX-License-Identifier: Apache-2.0
"""The weight sources satisfy the installed vLLM's WeightSource protocol, as
its IPC trainer engine consumes them (0.32: `iter(source)`; 0.33:
`metadata` as an attribute, `iter_full()`, `implements_iter_full()`,
`owned_names(rank)`), over FSDP2 on 2 gloo ranks."""

import inspect
import math

import pytest
import torch

from conftest import run_ranks


def _consume_as_vllm_does(trainer, ckpt, out_dir):
    from vllm.distributed.weight_transfer.base import WeightSource

    from proof import exact_check_engine, rank_measurement
    from weight_sync import sources

    trainer.build_model(str(ckpt))
    trainer.init_weights(str(ckpt), random_init=False)
    report = {}
    for loader in ("vllm", "direct"):
        # What rank_measurement.RankMeasurement gives vLLM's engine: the source, timed, then fingerprinted.
        source = rank_measurement.FingerprintedSource(rank_measurement.TimedSource(trainer.weight_source(loader), {}))
        for s in (source, source._source, source._source._source):
            assert isinstance(s, WeightSource) and not inspect.isabstract(type(s)), type(s)
        names = [m.name for m in source.metadata]
        assert source.metadata is source.metadata  # computed once: engines read it repeatedly
        passes = {"iter": [(n, t.detach().clone()) for n, t in iter(source)]}
        if "iter_full" in vars(WeightSource):  # vLLM >= 0.33 calls this instead
            assert source.implements_iter_full()
            assert source.owned_names(trainer.rank) == names  # IPC: every rank owns every tensor
            passes["iter_full"] = [(n, t.detach().clone()) for n, t in source.iter_full()]
        for got in passes.values():
            assert [n for n, _ in got] == names  # metadata order, every name once
            for (name, t), meta in zip(got, source.metadata, strict=True):
                assert (t.dtype, tuple(t.shape)) == (meta.dtype, tuple(meta.shape)), name
        first, *others = passes.values()
        for other in others:
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, other, strict=True))
        if loader == "vllm":  # fresh tensors, each its own: vLLM's unpacked send keeps them all
            kept = list(iter(source))
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, kept, strict=True))
        if loader == "direct":  # what weight_sender packs when the expert blocks go in place: all else
            blocks = list(source.expert_blocks)
            assert names[-len(blocks) :] == blocks  # the blocks come last
            part = sources.PackedPart(source, len(names) - len(blocks))
            # (each taken as the packed producer takes it: copied before the next; not fresh, it would not last)
            packed = [(n, t.clone()) for n, t in (part.iter_full() if "iter_full" in vars(WeightSource) else part)]
            assert [n for n, _ in packed] == [m.name for m in part.metadata] == names[: -len(blocks)]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(packed, first, strict=False))
            assert all(hasattr(p, "to_local") for p in trainer.model.parameters())  # what it gathered: resharded
            assert source.in_place is None  # CPU tensors (on a GPU, a bf16 trainer's go in place)
        # The exact check's half on the trainer, for the last pass: each tensor's fingerprint (in the
        # dtype vLLM holds it in, where that differs), most of them from the model's own shards.
        source.casts = {0: "float32"}  # (RankMeasurement.set_exact_casts)
        sent = [(n, t.detach().clone()) for n, t in iter(source)]
        held = [t.float() if i == 0 else t for i, (_, t) in enumerate(sent)]
        report[loader] = len(names)
        if loader == "direct":  # as a round does: started after the send, read back later
            source.start()
        report[f"{loader}_fingerprints"] = source.fingerprints()
        report[f"{loader}_want"] = [exact_check_engine.exact_fingerprint(t) for t in held]
        report[f"{loader}_uncast"] = [exact_check_engine.exact_fingerprint(t) for _, t in sent]
        report[f"{loader}_from_model"] = len(source._from_model)
    # InPlace exports a tensor's handle again only if it moved. Across a forward, in which FSDP2 swaps in the
    # gathered parameters and back, what it reads is what the model keeps, and nothing moved; a parameter
    # replaced, or its storage reallocated in place, moved.
    held = [n.rpartition(".") for n, _ in trainer.model.named_parameters()]
    in_place = sources.InPlace({f"{m}.{a}": (trainer.model.get_submodule(m), a) for m, _, a in held})
    first = in_place.local_tensors()
    assert [t.data_ptr() for t in first] == [sources._local(p).data_ptr() for p in trainer.model.parameters()]
    assert all(not t.requires_grad for t in first) and (where := in_place.moved(first)) is not None
    in_place._exported = (where, "handles")  # as gather() keeps them
    trainer.token_logprobs([[1, 2, 3]])
    kept = in_place.local_tensors()
    assert [t.data_ptr() for t in kept] == [t.data_ptr() for t in first] and in_place.moved(kept) is None
    module, attribute = in_place._where[0]
    setattr(module, attribute, torch.nn.Parameter(getattr(module, attribute).detach().clone()))
    replaced = in_place.local_tensors()
    assert replaced[0].data_ptr() == sources._local(getattr(module, attribute)).data_ptr() != first[0].data_ptr()
    assert in_place.moved(replaced) is not None
    in_place._exported = (in_place.moved(replaced), "handles")
    # The same tensor in new storage, as FSDP2 reallocates what it gathers (larger here, so surely elsewhere):
    storage = in_place.local_tensors()[1].untyped_storage()
    storage.resize_(2 * storage.nbytes())
    assert in_place.moved(in_place.local_tensors()) is not None
    torch.save(report, out_dir / f"rank{trainer.rank}.pt")


def test_the_weight_sources_are_vllm_weight_sources(tiny_checkpoint, tmp_path):
    from proof import rank_measurement

    run_ranks(_consume_as_vllm_does, 2, tiny_checkpoint, tmp_path)
    reports = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert reports[0]["vllm"] == reports[1]["vllm"] and reports[0]["vllm"] > reports[0]["direct"] > 0
    for loader in ("vllm", "direct"):
        # Each rank's shards of the dense tensors add up to what every rank sent whole; the
        # expert blocks are each rank's own.
        rank_fingerprints = rank_measurement.rank_fingerprints([r[f"{loader}_fingerprints"] for r in reports])
        for report, fingerprints in zip(reports, rank_fingerprints, strict=True):
            assert fingerprints == report[f"{loader}_want"], loader
            assert fingerprints != report[f"{loader}_uncast"], loader  # the cast counts
        assert reports[0][f"{loader}_fingerprints"]["partial"]  # FSDP2 shards over both ranks
    # From the model: every tensor of both loaders, vLLM's experts one at a time too (each expert's
    # slice of the fused tensor, fingerprinted by the rank that holds that expert, zeros on the other).
    assert reports[0]["direct_from_model"] == reports[0]["direct"]
    assert reports[0]["vllm_from_model"] == reports[0]["vllm"]


def test_a_trainer_tensor_is_cast_only_where_the_cast_changes_it():
    """What the trainer fingerprints from its model: cast to the sent dtype,
    then to vLLM's, only where that changes it; a tensor with no cast (the bf16
    weights without --train) is one a CUDA graph can fingerprint."""
    from proof import rank_measurement

    bf16, fp32 = torch.bfloat16, torch.float32
    assert rank_measurement._casts(bf16, bf16, None) == () and rank_measurement._casts(fp32, fp32, "float32") == ()
    assert rank_measurement._casts(fp32, bf16, None) == (bf16,)  # --train's fp32 masters, sent in bf16
    assert rank_measurement._casts(bf16, bf16, "float32") == (fp32,)  # a router vLLM keeps in fp32
    assert rank_measurement._casts(fp32, bf16, "float32") == (bf16, fp32)  # both: the bf16 rounding counts


def test_gpt_oss_experts_go_one_by_one_where_vllm_needs_it(monkeypatch):
    """vLLM 0.33 loads GPT-OSS's fused experts past its reload's weight loaders
    (they would stay unwritten) and takes each expert alone instead; 0.32 only
    the fused tensors. The vLLM loader's source sends what the installed one
    takes, and either way the same values."""
    from test_families import build_model

    from weight_sync import sources, vllm_adapter

    hf = build_model("gpt_oss", device="cpu")
    fused = dict(sources.CheckpointForm(hf, torch.bfloat16))
    # What the trainer holds: FSDP2's fully_shard gives the model a subclass of its own,
    # FSDPGptOssForCausalLM, which must not matter. (This one instance only.)
    hf.__class__ = type(f"FSDP{type(hf).__name__}", (type(hf),), {})
    as_installed = dict(iter(sources.BF16Source(hf)))
    if not vllm_adapter.takes_gpt_oss_experts_one_by_one():  # vLLM 0.32: as the checkpoint
        assert list(as_installed) == list(fused)
    monkeypatch.setattr(vllm_adapter, "takes_gpt_oss_experts_one_by_one", lambda: True)
    source = sources.BF16Source(hf)
    split = dict(iter(source))
    assert [m.name for m in source.metadata] == list(split)
    prefix = "model.layers.0.mlp.experts"
    for leaf, per_expert in [
        ("gate_up_proj", "w13_weight"),
        ("gate_up_proj_bias", "w13_bias"),
        ("down_proj", "w2_weight"),
        ("down_proj_bias", "w2_bias"),
    ]:
        whole = fused[f"{prefix}.{leaf}"]
        assert f"{prefix}.{leaf}" not in split
        assert torch.equal(torch.stack([split[f"{prefix}.{e}.{per_expert}"] for e in range(whole.shape[0])]), whole)
    assert sum(t.numel() for t in split.values()) == sum(t.numel() for t in fused.values())


def test_the_tensors_in_place_skip_the_buffer_only_through_the_client_that_hands_them_over(monkeypatch):
    """weight_sender leaves a source's tensors in place (its expert blocks,
    and every tensor the rank holds whole as it is sent) out of vLLM's packed
    buffer only when its client is the direct loader's client holding that
    source's InPlace (which hands their handles to the engines), or that
    client timed (rank_measurement.measure): through vLLM's routes, or with
    another source's, every tensor is packed. The packed buffer is no larger
    than what is packed. And measure builds the sender again around the
    source timed and fingerprinted, once however often it runs. (vLLM's IPC
    trainer engine needs a GPU, and so do the handles: here a stand-in
    records what the engine is given, and every rank's tensors count as a
    bf16 trainer's on a GPU.)"""
    from types import SimpleNamespace

    from test_families import build_model
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import helpers
    from proof import rank_measurement
    from weight_sync import sources

    given = []
    monkeypatch.setattr(
        WeightTransferTrainerFactory,
        "trainer_init",
        staticmethod(lambda info, client, source: given.append((client, source, info)) or object()),
    )
    monkeypatch.setattr(sources.InPlace, "possible", staticmethod(lambda tensors: dict.fromkeys(tensors, True)))
    model = build_model("qwen3_moe", device="cpu")
    source, other = sources.LocalExpertSource(model, 1), sources.LocalExpertSource(model, 1)
    names, blocks, in_place = [m.name for m in source.metadata], list(source.expert_blocks), source.in_place.names
    whole = [n for n, p in model.named_parameters() if n not in sources.expert_block_names(model)]
    assert in_place == whole + blocks and names[-len(in_place) :] == in_place  # in place: last, the blocks last

    def packed(client, from_source=source) -> list[str]:
        sender = helpers.weight_sender(0, client, from_source)
        assert given[-1][0] is sender.client and sender.source is from_source
        return [m.name for m in given[-1][1].metadata]

    direct = sources.DirectLoadClient("/nowhere/vllm.sock", [""], source.expert_blocks, source.in_place)
    assert packed(direct) == names[: -len(in_place)]
    assert given[-1][2].packed_buffer_size_bytes == max(helpers.metadata_bytes(given[-1][1].metadata), 1 << 20)
    assert packed(rank_measurement.TimedClient(direct, {})) == names[: -len(in_place)]
    assert packed(helpers.WeightSyncClient("/nowhere/vllm.sock")) == names
    assert given[-1][2].packed_buffer_size_bytes == helpers.metadata_bytes(source.metadata)  # all of it
    assert packed(sources.DirectLoadClient("/nowhere/vllm.sock", [""], source.expert_blocks)) == names
    assert packed(direct, from_source=other) == names

    # What a send's chunks carry in all (the client tells the last chunk by it): the packed part's bytes.
    def nbytes(metadata) -> int:
        return sum(math.prod(m.shape) * m.dtype.itemsize for m in metadata)

    client = sources.sync_client("/nowhere/vllm.sock", "direct", source, [""])
    packed(client)
    assert client.packed_bytes == nbytes(given[-1][1].metadata) < nbytes(source.metadata)
    none_in_place = SimpleNamespace(metadata=source.metadata, expert_blocks=source.expert_blocks)
    all_packed = sources.sync_client("/nowhere/vllm.sock", "direct", none_in_place, [""])
    assert all_packed.in_place is None and all_packed.packed_bytes == nbytes(source.metadata)
    with pytest.raises(ValueError, match="build the client for this source"):  # its last chunk would come early
        helpers.weight_sender(0, client, other)  # (other's tensors are not the client's: packed too)
    # The tensors in place are the model's own, read as they are now, and the source yields them too, for a
    # client that packs them: the same tensors, in the same order.
    yielded = dict(source.tensors())
    held = dict(model.named_parameters())
    for name in whole:
        assert yielded[name].data_ptr() == held[name].data_ptr(), name
    assert list(yielded) == names

    trainer = SimpleNamespace(
        sender=helpers.weight_sender(0, direct, source), device=torch.device("cpu"), model=model, optimizer=None
    )
    for _ in range(2):  # a second measure, with no setup between: still one layer of each
        rank_measurement._start_measuring(trainer)
        client, engine_source, _ = given[-1]
        assert isinstance(client.client, rank_measurement.TimedClient) and client.client._client is direct
        assert isinstance(engine_source, sources.PackedPart)
        fingerprinted = engine_source._source
        assert (
            isinstance(fingerprinted, rank_measurement.FingerprintedSource) and fingerprinted._source._source is source
        )
        assert isinstance(trainer.sender, rank_measurement.TimedSender)
        assert trainer.sender.in_place._in_place is source.in_place  # (its handshake timed)
        last = blocks[-1]
        assert trainer.measurement.sent_metadata()[-1] == [last, "bfloat16", list(source.expert_blocks[last]), True]


def test_the_syncs_own_collectives_run_on_a_default_group_without_a_cpu_backend():
    """A default process group with no backend for CPU tensors (made with init_process_group("cuda:gloo"), on a
    machine without a GPU: as a user's NCCL-only group cannot take a host-side collective's CPU tensors), 2 ranks
    under torchrun (tests/cuda_gloo_ranks.py): every collective of the sync runs on a gloo group of its own, from
    building the direct loader's source (its ranks agree which tensors go in place) to a send whose server
    refused a chunk, which every rank raises."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "cuda_gloo_ranks.py"],
        cwd=root / "tests",
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-3000:]
    assert "default group: cuda:gloo | sync group: cpu:gloo,cuda:gloo" in out, out
    assert "every rank: [0, 1]" in out and "on rank zero: called on rank 0" in out, out
    assert "rank GPUs: [{'gpu_id': None, 'gpu_uuid': ''}, {'gpu_id': None, 'gpu_uuid': ''}]" in out, out
    for rank in (0, 1):  # rank 0's failed call, raised on every rank rather than left for rank 1 to wait on
        assert f"rank {rank} raised: POST /sleep failed: FileNotFoundError" in out, out
        assert f"rank {rank} send raised: the send failed part way (2 tries); vLLM holds" in out, out
    assert "direct source: 25 tensors, 4 expert blocks" in out, out
    assert "a send that went through: retried 0 | rank 0 returned after every rank was through: True" in out, out


def test_vllms_module_source_goes_to_weight_sender_on_every_tested_vllm(monkeypatch):
    """weight_sender(rank, WeightSyncClient(sock), ModuleSource(model)), as the README shows it for vLLM's own
    loader: vLLM 0.32's ModuleSource has `metadata()` as a method, 0.33 and later as an attribute, and either
    reaches vLLM's IPC trainer engine with a buffer of its bytes. (The engine needs a GPU: a stand-in records
    what it is given.)"""
    from test_families import build_model
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import helpers

    given = []
    monkeypatch.setattr(
        WeightTransferTrainerFactory,
        "trainer_init",
        staticmethod(lambda info, client, source: given.append((client, source, info)) or object()),
    )
    model = build_model("qwen3", device="cpu")
    source = ModuleSource(model)
    sender = helpers.weight_sender(0, helpers.WeightSyncClient("/nowhere/vllm.sock"), source)
    metadata = helpers.source_metadata(source)
    assert [m.name for m in metadata] == [n for n, _ in model.named_parameters()]
    assert given[-1][1] is source and sender.in_place is None and sender.retries == 0
    assert given[-1][2].packed_buffer_size_bytes == helpers.metadata_bytes(metadata)
