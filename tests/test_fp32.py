# SPDX-License-Identifier: Apache-2.0
"""fp32 stays fp32: the tensors transformers keeps in fp32 whatever the
model's dtype (`_keep_in_fp32_modules_strict`: DeepSeek-V3's and GLM-4.5's
router e_score_correction_bias) are built, loaded, drawn and sent in fp32 by
the trainer, with bf16 weights and with fp32 master weights alike.

The checkpoints' biases are 2.0 + k * 2**-12, which bf16 cannot hold (its
step there is 2**-6): a bf16 copy anywhere on the way rounds them (2.0 +
2**-12 to 2.0), and no other check would notice, since trainer and vLLM
would agree on the rounded value."""

import pytest
import torch

from conftest import run_ranks
from weight_sync import models, sources

PRESETS = ("tiny-deepseek-v3", "tiny-glm4-moe")
BIAS = "e_score_correction_bias"


def _biases(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in tensors.items() if name.endswith(BIAS)}


def _bf16_cannot_hold(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype) != t


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> a checkpoint of it (random weights in bf16), with router
    biases in fp32 that bf16 cannot hold, each one different."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for preset in PRESETS:
        path = models.build_preset(preset, tmp_path_factory.mktemp(preset))
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        models.init_random_weights(model, seed=2)
        biases = _biases(sources.state_tensors(model))
        assert len(biases) == 2  # layers 1 and 2: layer 0 is dense
        for i, (name, bias) in enumerate(biases.items()):
            k = torch.arange(1, bias.numel() + 1) + 16 * i
            module, _, attr = name.rpartition(".")
            model.get_submodule(module)._buffers[attr] = 2.0 + k.to(torch.float32) * 2**-12
        model.save_pretrained(path)
        out[preset] = path
    return out


def _saved_biases(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    saved = _biases(load_file(path / "model.safetensors"))
    assert saved and all(t.dtype == torch.float32 and _bf16_cannot_hold(t).all() for t in saved.values())
    return saved


def test_meta_model_builds_each_tensor_in_the_dtype_from_pretrained_gives_it(checkpoints):
    """The trainer's meta build against transformers' own load, for bf16
    weights and for fp32 masters: the router biases in fp32 either way, the
    rest in the model's dtype."""
    from transformers import AutoModelForCausalLM

    for path in checkpoints.values():
        for dtype in (torch.bfloat16, torch.float32):
            built = sources.state_tensors(models.meta_model(path, dtype))
            loaded = sources.state_tensors(AutoModelForCausalLM.from_pretrained(path, dtype=dtype))
            assert {n: t.dtype for n, t in built.items()} == {n: t.dtype for n, t in loaded.items()}, (path, dtype)
            assert {t.dtype for t in _biases(built).values()} == {torch.float32}
            assert {t.dtype for n, t in built.items() if not n.endswith(BIAS)} == {dtype}


def test_a_parameter_transformers_keeps_in_fp32_is_built_in_fp32(tiny_checkpoint, monkeypatch):
    """The same for a parameter, which no preset has (ERNIE 4.5's fp32 router
    weight is built in fp32 by its own module): Qwen3-MoE keeping its
    routers' weights in fp32, as parameters still."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    monkeypatch.setattr(Qwen3MoeForCausalLM, "_keep_in_fp32_modules_strict", ["mlp.gate.weight"])
    model = models.meta_model(tiny_checkpoint, torch.bfloat16)
    built = sources.state_tensors(model)
    loaded = sources.state_tensors(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16))
    assert {n: t.dtype for n, t in built.items()} == {n: t.dtype for n, t in loaded.items()}
    gates = [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]
    assert [n for n, t in built.items() if t.dtype == torch.float32] == gates
    params = dict(model.named_parameters())
    assert all(isinstance(params[n], torch.nn.Parameter) and params[n].requires_grad for n in gates)


def _build_fill_and_send(trainer, checkpoints, out_dir):
    """For each checkpoint, with bf16 weights and with fp32 masters, from the
    checkpoint and at random: the router biases the trainer (the script's
    build_model and init_weights, under FSDP2) holds, and what it sends
    (sources.CheckpointForm, as BF16Source sends it)."""
    seen = {}
    for preset, path in checkpoints.items():
        for lr in (None, 1e-2):
            for random_init in (False, True):
                trainer.build_model(str(path), lr)
                trainer.init_weights(str(path), random_init=random_init, seed=4)
                held = _biases(sources.state_tensors(trainer.model))
                form = sources.CheckpointForm(trainer.model, torch.bfloat16)
                seen[preset, lr is not None, random_init] = {
                    "held": {n: t.detach().clone() for n, t in held.items()},
                    "metadata": {n: dtype for n, _, dtype in form.metadata if n.endswith(BIAS)},
                    "sent": {n: t.clone() for n, t in form if n.endswith(BIAS)},
                }
    torch.save(seen, out_dir / "seen.pt")


@pytest.fixture(scope="module")
def trainer_views(checkpoints, tmp_path_factory):
    """_build_fill_and_send on one FSDP2 rank (gloo): one process for all cases."""
    out_dir = tmp_path_factory.mktemp("trainer")
    run_ranks(_build_fill_and_send, 1, checkpoints, out_dir)
    return torch.load(out_dir / "seen.pt")


@pytest.mark.parametrize("masters", [False, True], ids=["bf16", "fp32-masters"])
@pytest.mark.parametrize("preset", PRESETS)
def test_the_checkpoints_fp32_biases_are_loaded_and_sent_exactly(checkpoints, trainer_views, preset, masters):
    saved = _saved_biases(checkpoints[preset])
    got = trainer_views[preset, masters, False]
    for what in ("held", "sent"):
        assert sorted(got[what]) == sorted(saved), what
        for name, bias in saved.items():
            assert got[what][name].dtype == torch.float32, (what, name)
            assert torch.equal(got[what][name], bias), (what, name, (got[what][name] - bias).abs().max())
    assert got["metadata"] == dict.fromkeys(saved, torch.float32)


@pytest.mark.parametrize("masters", [False, True], ids=["bf16", "fp32-masters"])
@pytest.mark.parametrize("preset", PRESETS)
def test_random_biases_are_drawn_and_sent_in_fp32(trainer_views, preset, masters):
    got = trainer_views[preset, masters, True]
    assert len(got["held"]) == 2 and sorted(got["sent"]) == sorted(got["held"])
    for name, bias in got["held"].items():
        assert bias.dtype == torch.float32, name
        assert _bf16_cannot_hold(bias).any(), name  # drawn in fp32, not rounded through bf16
        assert torch.equal(got["sent"][name], bias), name
    assert set(got["metadata"].values()) == {torch.float32}
