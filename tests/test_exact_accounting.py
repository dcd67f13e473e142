# SPDX-License-Identifier: Apache-2.0
"""The exact check accounts for every tensor the trainer sends, and its verdict counts only what it compared in
place (proof/exact_accounting.py), on real vLLM models on CPU through the worker extension's own calls: a
tensor vLLM writes nowhere, one written into another layer's parameter, an expert placed otherwise than the
trainer's layout, and a cast that loses bits each fail, named; what is compared by value only is counted as
not compared, with its reason."""

import json
import types

import pytest
import torch
from test_families import FAMILIES, _sent, _sync, build_model, vllm_models  # noqa: F401  (the fixture)

from proof import exact_accounting, exact_check_engine, exact_derived, exact_placement, rank_measurement
from weight_sync import sources
from weight_sync.direct_load import _expert_layers


def _worker(vllm_model, cls=exact_check_engine.ExactCheckWorker):
    worker = cls()  # the mixin vLLM's worker class gets: here around the model alone
    worker.model_runner = types.SimpleNamespace(get_model=lambda: vllm_model)
    worker.vllm_config = vllm_model.test_vllm_config
    return worker


def _random_model(family: str):
    hf = build_model(family, device="cpu")
    with torch.no_grad():
        for _, t in hf.named_parameters():
            t.normal_(mean=3.0)
    return hf


def _metas(sent) -> list:
    return [[n, str(t.dtype).removeprefix("torch."), list(t.shape), False] for n, t in sent]


def _round(worker, vllm_model, sent, view: dict | None = None) -> dict:
    """Prepare, sync through vLLM's loader, and take the engine's verdict, as a round does."""
    prepared = worker.exact_check_prepare(json.dumps(_metas(sent)), json.dumps(view) if view else "")
    casts = {int(i): d for i, d in prepared["casts"].items()}
    rows = {int(i): r for i, r in prepared["rows"].items()}
    expected = json.dumps({"": exact_check_engine.sent_fingerprints(sent, casts, rows)})
    _sync(vllm_model, sent, "vllm")
    worker.exact_check_start()
    return worker.exact_check(expected)


@pytest.fixture(scope="module")
def qwen3_moe(vllm_models):  # noqa: F811
    return _random_model("qwen3_moe"), vllm_models("qwen3_moe", own=True)


def test_a_true_sync_is_counted_bit_for_bit_and_a_sent_tensor_written_nowhere_fails(qwen3_moe):
    hf, vllm_model = qwen3_moe
    worker, sent = _worker(vllm_model), _sent(hf, "vllm")
    answer = _round(worker, vllm_model, sent)
    held = len(dict(vllm_model.named_parameters()))
    assert (answer["held"], answer["bit_for_bit"], answer["not_compared"], answer["casts"]) == (held, held, {}, [])
    # A tensor vLLM's loader takes and writes into no parameter (a buffer's name): every parameter still
    # holds what was sent, so only the accounting sees it.
    dropped = "model.layers.0.self_attn.rotary_emb.inv_freq"
    with pytest.raises(RuntimeError, match=rf"1 sent tensors not held as sent: {dropped}: .* into no parameter$"):
        _round(worker, vllm_model, [*sent, (dropped, torch.rand(16))])


def test_a_tensor_written_into_another_layers_parameter_of_its_shape_fails(qwen3_moe, vllm_models):  # noqa: F811
    """tests/misrouted_layer_worker.py's fault: layers 0 and 1 trade input_layernorm inside vLLM's loader, at
    the prepare's probes and at every sync, so each parameter holds a sent tensor of its shape."""
    from misrouted_layer_worker import MisroutedLayerWorker

    hf, _ = qwen3_moe
    vllm_model = vllm_models("qwen3_moe", own=True)  # its load_weights gets the fault
    with pytest.raises(RuntimeError, match=r"2 sent tensors not held as sent: .*another layer") as failed:
        _round(_worker(vllm_model, MisroutedLayerWorker), vllm_model, _sent(hf, "vllm"))
    assert "model.layers.0.input_layernorm.weight: written into model.layers.1.input_layernorm.weight" in str(
        failed.value
    )
    assert "parameters differ" not in str(failed.value)  # the parameters alone would pass


def test_a_tensor_written_into_a_same_shaped_neighbour_in_its_layer_fails(qwen3_moe, vllm_models):  # noqa: F811
    """A loader that maps layer 0's input_layernorm and post_attention_layernorm onto each other, at the
    prepare's probes and at every sync: each parameter holds a sent tensor of its shape, in its own layer, so
    only the tensor's own name tells. Both are named."""
    hf, _ = qwen3_moe
    vllm_model = vllm_models("qwen3_moe", own=True)
    swap = {
        "model.layers.0.input_layernorm.weight": "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight": "model.layers.0.input_layernorm.weight",
    }
    load = vllm_model.load_weights
    vllm_model.load_weights = lambda weights, *a, **k: load(((swap.get(n, n), t) for n, t in weights), *a, **k)
    with pytest.raises(RuntimeError, match=r"2 sent tensors not held as sent: .*of its own name") as failed:
        _round(_worker(vllm_model), vllm_model, _sent(hf, "vllm"))
    assert (
        "model.layers.0.input_layernorm.weight: written into model.layers.0.post_attention_layernorm.weight, "
        "not into vLLM's parameter of its own name" in str(failed.value)
    )


def test_each_expert_is_held_where_the_trainers_layout_puts_it(qwen3_moe):
    """The trainer's layout, not the engine's map, decides which engine must hold an expert: an expert the
    trainer puts on another GPU that vLLM holds here fails, and one it puts here that vLLM's map places
    elsewhere fails; with the two agreeing, the expert is not looked for here."""
    hf, vllm_model = qwen3_moe
    worker, sent = _worker(vllm_model), _sent(hf, "vllm")
    expert_1 = [i for i, (n, _) in enumerate(sent) if ".layers.1.mlp.experts.1." in n]
    assert len(expert_1) == 3
    view = {"trainer_gpu_uuids": ["", "GPU-b"], "holders": {i: 1 for i in expert_1}}
    with pytest.raises(RuntimeError, match=r"3 sent tensors not held as sent: .*experts\.1\.gate_proj.* puts expert"):
        _round(worker, vllm_model, sent, view)
    metas = _metas(sent)
    targets, casts, _, _ = exact_placement.exact_targets(vllm_model, metas, vllm_model.test_vllm_config)
    manager = _expert_layers(vllm_model)["model.layers.1.mlp.experts"].expert_map_manager
    kept = manager._expert_map
    try:  # vLLM's map as another engine's: expert 1 of layer 1 not held here
        manager._expert_map = torch.tensor([0, -1, 1, 2, 3, 4, 5, 6])
        problems, _ = exact_accounting.unaccounted(vllm_model, metas, targets, casts, 0, {})
        assert len(problems) == 3 and "vLLM's expert map on another engine" in problems[0], problems
        holders = {i: 1 for i in expert_1}
        assert exact_accounting.unaccounted(vllm_model, metas, targets, casts, 0, holders) == ([], [])
    finally:
        manager._expert_map = kept
    # Whose is whose, from the trainer: each rank's own experts; any other expert tensor as FSDP2 cuts dim 0.
    source = sources.BF16Source(hf)
    own = rank_measurement.RankMeasurement.own_experts(types.SimpleNamespace(sent_source=source))
    names = [m.name for m in source.metadata]
    assert own == [i for i, n in enumerate(names) if ".experts." in n] and len(own) == 2 * 8 * 3
    assert exact_accounting.expert_holders(names, [own, []]) == {i: 0 for i in own}
    by_chunk = exact_accounting.expert_holders(names, [[], []])
    assert {by_chunk[i] for i in expert_1} == {0} and by_chunk[names.index(names[own[-1]])] == 1


def test_a_cast_that_loses_bits_fails_and_one_that_keeps_them_is_listed(qwen3_moe, vllm_models):  # noqa: F811
    hf, vllm_model = qwen3_moe
    sent = _sent(hf, "vllm")
    # An fp32 tensor vLLM holds in bf16: compared after the cast it would pass.
    fp32 = [(n, t.float() + 1e-3 if n == "model.norm.weight" else t) for n, t in sent]
    with pytest.raises(RuntimeError, match=r"model\.norm\.weight: float32 sent, held as bfloat16, which loses bits"):
        _round(_worker(vllm_model), vllm_model, fp32)
    # GLM-4.5 keeps its routers in fp32: bf16 sent, every bit kept, listed.
    glm = vllm_models("glm4_moe")
    metas = _metas(_sent(build_model("glm4_moe", device="cpu"), "vllm"))
    targets, casts, _, _ = exact_placement.exact_targets(glm, metas, glm.test_vllm_config)
    problems, kept = exact_accounting.unaccounted(glm, metas, targets, casts, None, {})
    assert problems == [] and kept == [f"model.layers.{i}.mlp.gate.weight: bfloat16 sent, float32 held" for i in (1, 2)]


def test_what_vllm_lays_out_its_own_way_is_counted_as_not_compared(vllm_models):  # noqa: F811
    """GPT-OSS's experts through vLLM's loader are compared by value only: the verdict counts them as not
    compared, with the reason, and the rest as compared bit for bit."""
    vllm_model = vllm_models("gpt_oss")
    sent = _sent(_random_model("gpt_oss"), "vllm")
    answer = _round(_worker(vllm_model), vllm_model, sent)
    experts = [n for n, _ in vllm_model.named_parameters() if ".experts." in n]
    assert answer["not_compared"] == {"by_value": experts} and len(experts) == 8
    assert answer["bit_for_bit"] == answer["held"] - 8 == len(dict(vllm_model.named_parameters())) - 8


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_true_sync_is_accounted_for(family, vllm_models):  # noqa: F811
    """Each family's tensors, as the trainer sends them to vLLM's loader, land where the accounting expects:
    none unaccounted for on one engine, so none of its rules fails a true sync."""
    vllm_model = vllm_models(family)
    metas = _metas(_sent(build_model(family, device="cpu"), "vllm"))
    targets, casts, _, _ = exact_placement.exact_targets(vllm_model, metas, vllm_model.test_vllm_config)
    problems, _ = exact_accounting.unaccounted(vllm_model, metas, targets, casts, None, {})
    assert problems == []


def test_a_derived_parameter_is_a_view_only_inside_the_memory_of_a_parameter_compared():
    """A derived parameter is counted as a view of a compared one only if its elements lie inside that one's:
    sharing a storage with it, as parameters cut from one buffer do, is not enough."""
    buffer = torch.arange(32.0)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(buffer[:16].view(4, 4), requires_grad=False)
    layer.inside = torch.nn.Parameter(buffer[:16].view(4, 4).t()[1:, :2], requires_grad=False)
    layer.beside = torch.nn.Parameter(buffer[16:20], requires_grad=False)  # same storage, other memory
    layer.own = torch.nn.Parameter(buffer[:16].clone(), requires_grad=False)
    derived = {"inside", "beside", "own"}
    assert exact_derived.derived_views(layer, derived, {"weight"}) == {"inside": "weight"}
    assert exact_derived.derived_views(layer, derived, set()) == {}  # nothing compared, nothing viewed
