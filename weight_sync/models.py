# SPDX-License-Identifier: Apache-2.0
"""Find, build and load the models for rlhf_ipc_fsdp_ep.py.

A Hugging Face id or a local directory is loaded as it is. A preset needs no download and no checkpoint: it is
built locally from a config and gets random weights. "tiny" has Qwen3-30B-A3B's structure at toy size,
"qwen3-30b-a3b-shape" has its exact shapes, 61 GB in bf16, and "moonlight-16b-a3b-shape" has Moonlight-16B-A3B's,
32 GB in bf16.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from weight_sync import sources
from weight_sync.model_families import FAMILIES

_QWEN3_MOE_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# vLLM's CPU attention needs head_dim >= 32. 8 experts split evenly over 1, 2, 4 or 8 expert-parallel ranks.
PRESETS = {
    "tiny": {
        **_QWEN3_MOE_COMMON,
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 2048,
    },
    "qwen3-30b-a3b-shape": {
        **_QWEN3_MOE_COMMON,
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 40960,
    },
}

# The published config of moonshotai/Moonlight-16B-A3B, with random weights: a model people train, which fits
# on one GPU at 32 GB in bf16. It has DeepSeek-V3's architecture with MLA and no query LoRA, 64 routed and 2
# shared experts, and 27 layers.
PRESETS["moonlight-16b-a3b-shape"] = {
    **FAMILIES["deepseek_v3"],
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.446,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "max_position_embeddings": 8192,
}

# One small random model per MoE family in model_families.py: tiny-mixtral, tiny-deepseek-v3, ...
PRESETS.update({f"tiny-{name.replace('_', '-')}": config for name, config in FAMILIES.items() if name != "qwen3_moe"})

_TOKENIZER_CORPUS = (
    "The capital of France is Paris. The future of AI is bright. Hello, my name is "
    "Ada and I like to train models. Reinforcement learning from human feedback "
    "moves weights from a trainer into an inference server after every step. "
    "The quick brown fox jumps over the lazy dog. One two three four five six "
    "seven eight nine ten. Experts route tokens; attention mixes them."
)


def resolve_model(model: str, workdir: Path) -> Path:
    """Return the model's directory, or exit with a one-line error.

    A preset is built once in this user's cache by preset_dir, or in `workdir` if that cache is not safe to use.
    A path is used as given, and a Hugging Face id is downloaded."""
    if model in PRESETS:
        cached = preset_dir(model)
        return cached if cached is not None else build_preset(model, workdir / model)
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1
    if looks_local:
        if not (path / "config.json").is_file():
            raise SystemExit(f"error: model path {model!r} has no config.json (does it exist?)")
        return path.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model))
    except Exception as e:  # offline, unknown id, no access: all end here
        raise SystemExit(f"error: could not download {model!r}: {e}") from e


# A plain chat format for the presets' tokenizers, which have no chat template of their own.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def preset_dir(name: str) -> Path | None:
    """Build PRESETS[name] once, at a path that stays the same from run to run, and return that path.

    The path is rlhf_ipc_fsdp_ep/presets/<name>-<hash of what is written> under $XDG_CACHE_HOME or ~/.cache.
    vLLM keys its torch.compile cache on the model's path, so a server of the same preset starts from the last
    run's compiled code instead of compiling again. Return None if that folder, or one above it in the cache, is
    not this user's alone, since another user could change the files in it."""
    import hashlib
    import importlib.metadata
    import inspect
    import tempfile

    versions = [importlib.metadata.version(p) for p in ("tokenizers", "transformers")]
    recipe = json.dumps(
        [PRESETS[name], inspect.getsource(build_preset), CHAT_TEMPLATE, _TOKENIZER_CORPUS, versions], sort_keys=True
    )
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = base / "rlhf_ipc_fsdp_ep" / "presets"
    out = root / f"{name}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _mine_alone(root, base):
            return None
        if not (out / "config.json").is_file():
            building = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            try:
                build_preset(name, building).rename(out)  # whole or not at all: two runs may build it at once
            except OSError:  # another run built it first
                pass
            finally:
                shutil.rmtree(building, ignore_errors=True)
        return out if _mine_alone(out, base) and (out / "config.json").is_file() else None
    except OSError:  # no home directory, or a read-only one
        return None


def _mine_alone(path: Path, base: Path) -> bool:
    """Return whether `path`, and each folder above it up to `base`, is this user's and writable by no one else."""
    for folder in [path, *path.parents]:
        info = folder.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return False
        if folder == base:
            return True
    return False


def build_preset(name: str, out_dir: str | os.PathLike) -> Path:
    """Write config.json for PRESETS[name] and a small byte-level BPE
    tokenizer (a few hundred tokens; the config's vocabulary is larger).
    No weight files: the server starts with --load-format dummy and the
    trainer draws random weights."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<pad>", "<s>", "</s>"],  # ids 0, 1, 2 as in the config
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TOKENIZER_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE  # so /v1/chat/completions works on a preset too
    fast.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(PRESETS[name], indent=2))
    return out


def meta_model(model_path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Build the model's modules and parameter shapes on the meta device, with no memory behind them.

    Each tensor gets the dtype that `from_pretrained(model_path, dtype=dtype)` would give it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=dtype)
    _keep_in_fp32(model, dtype)
    return model


def _keep_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to fp32 the parameters and persistent buffers that transformers keeps in fp32 whatever the dtype.

    They come from the model's dtype plan: `_keep_in_fp32_modules_strict` for bf16, such as the routers'
    e_score_correction_bias, and `_keep_in_fp32_modules` as well for fp16. `from_config` builds them in `dtype`,
    since only `from_pretrained` applies the plan, as it loads. A tensor built in bf16 stays bf16 through
    to_empty, the random init and the checkpoint load, which casts to the destination's dtype. An fp32
    checkpoint's 2.0 + 2**-12 would then become 2.0 on the trainer, and vLLM would receive the rounded value
    with no check to notice. Names match the plan as they do in transformers' loader."""
    from transformers.core_model_loading import build_glob_alternation

    if not (plan := model._get_dtype_plan(dtype)):
        return
    pattern, glob_of_group, _ = build_glob_alternation(list(plan))
    for name, tensor in sources.state_tensors(model).items():
        if not tensor.is_floating_point() or not (match := pattern.search(name)):
            continue
        want = plan[glob_of_group[match.lastgroup]]
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = tensor.data.to(want)  # keep the same Parameter, so that ties and references to it hold
        else:
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = tensor.to(want)


def architecture(model_path: str | os.PathLike) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).architectures[0]


def context_length(model_path: str | os.PathLike) -> int | None:
    """Return the text model's max_position_embeddings from the config, or None."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "max_position_embeddings", None)


def has_experts(model_path: str | os.PathLike) -> bool:
    """Return whether the model has fused expert tensors: vLLM refuses --enable-expert-parallel without them."""
    return bool(sources.fused_expert_tensors(meta_model(model_path)))


def largest_parameter(model: torch.nn.Module) -> tuple[str, int]:
    """Return the name and bf16 size in bytes of the model's largest parameter; a meta_model will do."""
    name, param = max(model.named_parameters(), key=lambda kv: kv[1].numel())
    return name, param.numel() * torch.bfloat16.itemsize


def restore_rotary_tables(model: torch.nn.Module) -> None:
    """Rebuild the rotary tables, which to_empty() leaves uninitialised.

    The other buffers, such as a router's correction bias, are persistent: init_random_weights or the checkpoint
    fills them."""
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill the model with random weights that give the logits a real spread, so that a missed sync shows.

    vLLM's dummy weights are near zero. Each rank fills its own shard, and norms get 1. Persistent buffers, such
    as a router's correction bias, which transformers' init sets to zero, get small values, the same on every
    rank, so that a sync that misses one shows in the gate."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    params = dict(model.named_parameters())
    for i, (name, buf) in enumerate(sources.state_tensors(model).items()):
        if name not in params and buf.is_floating_point():
            gen = torch.Generator(device=buf.device).manual_seed(seed * 1_000_003 + i)
            buf.normal_(0.0, 0.01, generator=gen)
    for i, (name, param) in enumerate(model.named_parameters()):
        local = param.to_local() if hasattr(param, "to_local") else param
        if "norm" in name:
            local.fill_(1.0)
            continue
        gen = torch.Generator(device=local.device)
        gen.manual_seed(seed * 1_000_003 + i * 101 + rank)
        std = 1.0 if "embed_tokens" in name else param.shape[-1] ** -0.5
        local.normal_(0.0, std, generator=gen)


def load_pretrained_weights(model: torch.nn.Module, model_path: str | os.PathLike) -> int:
    """Fill `model` from the checkpoint's safetensors files and return the bytes this rank read.

    `model` is sharded with FSDP2 and allocated with to_empty. Each rank reads only what its own shards need,
    on its own with no collective. No GPU memory is taken beyond the shards: the files are read and converted
    on the CPU, then copied in.

    transformers' own loader does the work. `convert_and_load_state_dict_in_model`, which `from_pretrained`
    calls, reads every checkpoint tensor lazily, slices each one whose destination is a DTensor to this rank's
    rows, and runs the model's conversions on that part, such as per-expert tensors into fused experts, and
    renames. For fused experts, only this rank's experts' tensors are read. One step does not fit: it assigns a
    new Parameter to each module, which would detach FSDP2's own, so for this call it copies into the existing
    shard instead."""
    from safetensors import safe_open
    from transformers import core_model_loading
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig

    if getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(f"{model_path}: a quantized checkpoint; the trainer loads unquantized ones only")
    if not (paths := checkpoint_files(Path(model_path))):
        raise ValueError(f"{model_path} has no safetensors files on this node (model.safetensors, or an index)")
    read, mapping = [0], get_model_conversion_mapping(model)  # the conversions from_pretrained applies
    with ExitStack() as files:
        slices = {}  # checkpoint name -> a lazy slice of its memory-mapped file
        for path in paths:
            f = files.enter_context(safe_open(path, framework="pt", device="cpu"))
            slices.update({name: _CountedSlice(f.get_slice(name), read) for name in f.keys()})
        # dtype None casts each tensor to its destination's dtype: bf16 or fp32 master weights, and fp32 where
        # transformers keeps a tensor in fp32, as meta_model built it.
        config = LoadStateDictConfig(dtype=None, device_map={"": "cpu"}, weight_mapping=mapping)
        # The patch is process-wide while it lasts, so allow one load at a time and no other from_pretrained
        # in this process meanwhile: its set_param_for_module would be ours.
        with (
            _ONE_LOAD_AT_A_TIME,
            mock.patch.object(core_model_loading, "set_param_for_module", _copy_into_shard),
            _env("HF_DEACTIVATE_ASYNC_LOAD", "1"),
        ):  # read one tensor at a time, not all of them ahead
            info, _ = core_model_loading.convert_and_load_state_dict_in_model(model, slices, config)
    _check_loaded(model, model_path, mapping, info)
    return read[0]


_ONE_LOAD_AT_A_TIME = threading.Lock()


@contextmanager
def _env(key: str, value: str):
    """Set os.environ[key] = value for a while, changing only that key.

    mock.patch.dict would clear and refill the whole environment under other threads."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def checkpoint_files(model_path: Path) -> list[Path]:
    """Return the checkpoint's safetensors files, or [] if it has none."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return [model_path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [model_path / "model.safetensors"] if (model_path / "model.safetensors").is_file() else []


class _CountedSlice:
    """A safetensors slice that adds the bytes of each read to `counter[0]`."""

    def __init__(self, file_slice, counter: list[int]) -> None:
        self._slice, self._counter = file_slice, counter
        self.get_shape, self.get_dtype = file_slice.get_shape, file_slice.get_dtype

    def __getitem__(self, index):
        t = self._slice[index]
        self._counter[0] += t.numel() * t.element_size()
        return t


def _copy_into_shard(model, target_name, value, loading_info, hf_quantizer=None) -> None:
    """Do transformers' set_param_for_module, but copy into the tensor the model has instead of replacing it.

    That tensor is a DTensor's local shard, or a buffer."""
    module_name, _, attr = target_name.rpartition(".")
    if attr == "_extra_state":
        raise ValueError(f"{target_name}: a module's extra state; the trainer loads tensors only")
    held = getattr(model.get_submodule(module_name), attr)
    dest = held.to_local() if hasattr(held, "to_local") else held
    value = value[0] if isinstance(value, list) else value
    loading_info.missing_keys.discard(target_name)
    if dest.shape != value.shape:
        loading_info.mismatched_keys.add((target_name, tuple(value.shape), tuple(dest.shape)))
        return
    with torch.no_grad():
        dest.copy_(value)


def _check_loaded(model: torch.nn.Module, model_path, mapping: list, info) -> None:
    """Raise unless every tensor was filled, each by a conversion that stays right when sliced by rows."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    # Each source tensor was sliced by its destination's rows on dim 0. That is right for renames and for stacking
    # experts on dim 0, then concatenating on a later dim, but not for chunking a fused qkv, for example.
    for conversion in mapping:
        ops = getattr(conversion, "operations", [])
        if conversion.was_used() and not all(
            (isinstance(op, MergeModulelist) and op.dim == 0) or (isinstance(op, Concatenate) and op.dim > 0)
            for op in ops
        ):
            raise ValueError(f"{model_path}: cannot load {conversion} by rows; a trainer shard needs it whole")
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # filled through their source
    # FSDP2 splits like torch.chunk, so a rank can hold no rows of a tensor, e.g. 60 experts over 16 ranks.
    # transformers then reads none of its sources and reports it missing or unconvertible.
    empty = {
        n
        for n, t in sources.state_tensors(model).items()
        if (t.to_local() if hasattr(t, "to_local") else t).numel() == 0
    }
    problems = {
        "missing": sorted(info.missing_keys - tied - empty),
        "of another shape": sorted(info.mismatched_keys),
        "not converted": sorted(set(info.conversion_errors) - empty),
    }
    if any(problems.values()):
        raise ValueError(
            f"checkpoint {model_path} does not fit the model: { {k: v[:5] for k, v in problems.items() if v} }"
        )
