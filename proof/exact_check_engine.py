# SPDX-License-Identifier: Apache-2.0
"""Prove on each engine that every DP engine holds, bit for bit, what the trainer rank on its GPU sent.

This is the engine's half of the exact check, and its fingerprint. `ExactCheckWorker` is the direct
loader's worker extension from direct_load.py with the exact check's calls added. rlhf_ipc_fsdp_ep.py
starts the server with `--worker-extension-cls exact_check_engine.ExactCheckWorker`. Its calls, made
through `/collective_rpc` on every engine, are:

    exact_check_prepare(sent)   once: which parameters each sent tensor is written into, at which rows
    exact_check_start()         after a sync: fingerprint what the engine holds, beside serving
    exact_check(expected)       compare with the trainer's fingerprints; raise naming what differs
    direct_load_fingerprint(a)  'store' / 'compare' every parameter, for benchmark.py's loaders_agree

The trainer's half, rank_measurement.FingerprintedSource, fingerprints what each rank sent with the same
function, `exact_fingerprint`. It uses integer arithmetic that gives the same result on a GPU and a CPU,
so the two sides' sums match exactly.
"""

from __future__ import annotations

import json
import math
import re
import time

import torch

from weight_sync import fp8_experts
from weight_sync.direct_load import (
    EXPERT_TENSORS,
    DirectLoadWorker,
    _expert_layers,
    _gpu_uuid,
    _no_trainer_rank,
    fp8_scales,
    local_expert_ids,
)
from weight_sync.fp8_experts import fp8_reference, fp8_shards
from weight_sync.vllm_adapter import internal

try:  # vLLM's GPU builds depend on Triton; without it, the torch code fingerprints everything.
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # Captures the expert id of one expert's checkpoint tensor.


class ExactCheckWorker(DirectLoadWorker):
    """Add the exact check's calls to DirectLoadWorker; every method runs on every engine."""

    def direct_load_start(self, in_place: str | dict = "") -> dict:
        self._exact_started = None  # Fingerprints of the weights held before this sync are now stale.
        if getattr(self, "_profile_path", None) and getattr(self, "_profiler", None) is None:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()
        return super().direct_load_start(in_place)

    def profile_next_sync(self, path: str) -> dict:
        """Profile this engine's Python in the next direct sync with cProfile.

        When the sync finishes, its top functions by cumulative time are written to `path` with the engine's
        DP rank appended.
        """
        self._profile_path = f"{path}.engine{self.vllm_config.parallel_config.data_parallel_rank}.txt"
        return {"path": self._profile_path}

    def direct_load_finish(self) -> dict:
        try:
            return super().direct_load_finish()
        finally:
            if (profiler := getattr(self, "_profiler", None)) is not None:
                profiler.disable()
                _write_profile(profiler, self._profile_path)
                self._profiler = self._profile_path = None

    def direct_load_fingerprint(self, action: str) -> dict:
        """Store a fingerprint of every parameter, or compare every parameter with the stored one.

        With 'compare', raise naming the parameters that differ, so a mismatch on any DP engine fails the call.
        """
        model = self.model_runner.get_model()
        prints = {name: _fingerprint(p) for name, p in model.named_parameters()}
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank
        if action == "store":
            self._direct_reference = prints
            return {"dp_rank": dp_rank, "parameters": len(prints)}
        if action != "compare":
            raise ValueError(f"action must be 'store' or 'compare', not {action!r}")
        reference = getattr(self, "_direct_reference", None)
        if reference is None:
            raise RuntimeError("no stored fingerprint: call with 'store' first")
        differ = sorted(n for n in reference.keys() | prints.keys() if reference.get(n) != prints.get(n))
        if differ:
            raise RuntimeError(
                f"DP rank {dp_rank}: {len(differ)} of {len(reference)} parameters differ from "
                f"the stored fingerprint: {differ[:8]}"
            )
        return {"dp_rank": dp_rank, "parameters": len(reference), "differ": differ}

    def exact_check_prepare(self, sent: str) -> dict:
        """Learn which of this engine's parameters each tensor the trainer sends is written into.

        `sent` is JSON [[name, dtype, shape, is_expert_block], ...], the source's metadata in send order; see
        exact_targets. Also learn where each piece of a parameter written from several tensors lands in it,
        returned as "rows" from piece_rows, for the trainer to fingerprint each piece at. Call it before a
        full sync, because it leaves every parameter it probes zeroed until the sync overwrites it.
        """
        model, sent = self.model_runner.get_model(), json.loads(sent)
        self._exact_targets, casts, self._exact_values_only, whole = exact_targets(model, sent, self.vllm_config)
        rows, placed, by_value = piece_rows(model, sent, self._exact_targets, whole, self._exact_values_only)
        self._exact_whole = sorted(set(whole) | set(placed))  # Every element is compared in its place.
        with torch.no_grad():  # Zero the probes' constants, up to 3e38, which would overflow what it serves.
            params = dict(model.named_parameters())
            for name in probed_parameters(sent, self._exact_targets):
                params[name].zero_()
        self._exact_unchecked = quantized_by_vllms_loader(model, sent)
        self._held_fingerprints, self._exact_started = HeldFingerprints(), None
        exact_fingerprints(p for _, p in model.named_parameters())  # Let Triton compile its kernels now, not in a sync.
        return {
            "tensors": len(self._exact_targets),
            "casts": casts,
            "values_only": self._exact_values_only,
            "parameters": len({t for ts in self._exact_targets for t in ts}),
            "unchecked": self._exact_unchecked,
            "rows": rows,
            "by_value": by_value,
        }

    def exact_check_start(self) -> dict:
        """Start fingerprinting what this engine holds after a sync, on its own CUDA stream.

        It runs beside whatever the engine serves next. exact_check waits for it, or fingerprints then if
        this was not called.
        """
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        names = checked_parameters(model, targets)
        self._exact_started = self._held_fingerprints.start(params[n] for n in names)
        return {"parameters": len(names)}

    def exact_check(self, expected: str) -> dict:
        """Prove that this engine holds exactly what the trainer rank on its GPU sent.

        `expected` is JSON {gpu_uuid: [[plain, by_column, by_position], ...]} in the order exact_check_prepare
        was given; see exact_problems. Raise, naming this DP engine and the parameters that differ, if any do.
        """
        start = time.perf_counter()
        started, self._exact_started = getattr(self, "_exact_started", None), None  # Use it at most once.
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        uuid = _gpu_uuid(next(model.parameters()).device)
        per_rank = json.loads(expected)
        sent = per_rank[uuid] if uuid in per_rank else _no_trainer_rank(uuid, list(per_rank))
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank

        def fingerprints(tensors):  # Those exact_check_start launched for the same parameters, else new ones.
            return started() if started is not None else self._held_fingerprints(tensors)

        checked, problems = exact_problems(
            model,
            targets,
            sent,
            self._exact_values_only,
            self._exact_whole,
            fingerprints,
            unchecked=getattr(self, "_exact_unchecked", ()),
        )
        if problems:
            fp8_parameters = fp8_parameter_names(model)
            if any(problem.split(": ", 1)[0] in fp8_parameters for problem in problems):
                # Quantize through vLLM's own function from the next sync on.
                fp8_experts._KERNEL_AGREES[next(model.parameters()).device] = False
            raise RuntimeError(
                f"exact check: DP engine {dp_rank}: {len(problems)} of {checked} parameters "
                f"differ: " + "; ".join(problems[:4])
            )
        return {"dp_rank": dp_rank, "parameters": checked, "seconds": time.perf_counter() - start}

    def _exact_targets_or_raise(self) -> list[list[str]]:
        targets = getattr(self, "_exact_targets", None)
        if targets is None:
            raise RuntimeError("exact_check_prepare was not called")
        return targets


_FINGERPRINT_CHUNK = 1 << 24  # Elements per step, to bound the temporary memory.


def _write_profile(profiler, path: str) -> None:
    """Write the profile's 60 functions with the most cumulative time to `path` as text."""
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
    with open(path, "w") as f:
        f.write(out.getvalue())


def _fingerprint(tensor: torch.Tensor) -> str:
    """Return a checksum of a tensor's shape, dtype and every element in its place, computed on its device.

    direct_load_fingerprint uses it to compare an engine's parameters with themselves.
    """
    return f"{tuple(tensor.shape)}:{tensor.dtype}:{':'.join(map(str, exact_fingerprint(tensor)))}"


def exact_targets(
    model: torch.nn.Module, sent: list, vllm_config
) -> tuple[list[list[str]], dict[int, str], list[str], list[str]]:
    """Find the parameters of `model` that each sent tensor is written into, and how to compare them.

    `sent` lists [name, dtype, shape, is a direct-loader expert block] in send order. Each tensor is loaded
    once as its own constant through the model's own `load_weights`, so whatever the model family stacks or
    renames is followed; piece_rows then reads the constants back. An expert block maps to its layer's fused
    parameter. A tensor of an expert that another engine holds is written nowhere here.

    Return four things: the targets per sent tensor; {index: dtype} of the tensors vLLM holds in another
    dtype than they are sent in, such as a router kept in fp32, which the trainer fingerprints after the same
    cast vLLM's loader makes; the parameters to compare by value alone, from _relaid_out; and the parameters
    written whole from one tensor of their shape, compared element by element.
    """
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")

    device = next(model.parameters()).device
    layers = _expert_layers(model)  # By vLLM's layer name.
    where = {id(module): prefix for prefix, module in model.named_modules()}  # Each module's parameter prefix.
    by_prefix = {where[id(layer)]: layer for layer in layers.values()}
    targets, quantized = [], {}
    # vLLM names an expert layer as the checkpoint does, e.g. model.layers.0.mlp.experts, but its
    # parameters may sit deeper, e.g. model.layers.0.mlp.experts.routed_experts.w13_weight.
    unchecked_layers = tuple(f"{layer.layer_name}." for _, layer in _fp8_layers_by_vllms_loader(model, sent))
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for index, (name, dtype, shape, block) in enumerate(sent):
            if block:
                layer_name, _, tensor_name = name.rpartition(".")
                layer, param_name = layers[layer_name], EXPERT_TENSORS[tensor_name]
                targets.append([f"{where[id(layer)]}.{param_name}"])
                if fp8_scales(layer, param_name) is not None:  # FP8 writes its weight and its scales, each whole.
                    targets[-1].append(f"{targets[-1][0]}_scale_inv")
                    quantized[index] = f"{FP8_BLOCKS}{fp8_shards(layer, param_name)}"
                continue
            if unchecked_layers and name.startswith(unchecked_layers):  # FP8 expert layers are not probed.
                targets.append([])
                continue
            # Use a distinct constant, not zeros, so piece_rows can read back where each piece landed.
            loaded = sorted(model.load_weights([(name, _probe(index, shape, dtype, device))]) or ())
            targets.append([t for t in loaded if not _held_elsewhere(name, by_prefix.get(t.rpartition(".")[0]))])
    params = dict(model.named_parameters())
    casts = {}
    for index, ((_, dtype, _, _), names) in enumerate(zip(sent, targets, strict=True)):
        held = {str(params[n].dtype).removeprefix("torch.") for n in names if n in params}
        if index in quantized:
            casts[index] = quantized[index]
        elif held and held != {dtype}:
            casts[index] = held.pop()
    pieces: dict[str, list[int]] = {}
    for index, names in enumerate(targets):
        for n in names:
            pieces.setdefault(n, []).append(index)
    whole = sorted(
        n
        for n, idx in pieces.items()
        if len(idx) == 1 and n in params and (tuple(sent[idx[0]][2]) == tuple(params[n].shape) or idx[0] in quantized)
    )
    return targets, casts, _relaid_out(sent, targets, by_prefix), whole


def _relaid_out(sent: list, targets: list[list[str]], by_prefix: dict) -> list[str]:
    """Return the fused-expert parameters that can only be compared by their values.

    vLLM's own loader lays out its own way what it fills from a fused checkpoint tensor or from GPT-OSS's
    per-expert tensors; GPT-OSS's become [E, H, 2I], transposed. The direct loader's blocks are copied
    unchanged and other families' per-expert tensors are stacked, so those are compared whole.
    """
    out = set()
    for (name, _, _, block), names in zip(sent, targets, strict=True):
        gpt_oss_expert = re.search(r"\.experts\.\d+\.w(13|2)_(weight|bias)$", name)  # vLLM transposes these.
        if block or (_ONE_EXPERT.search(name) and not gpt_oss_expert):
            continue
        out |= {t for t in names if t.rpartition(".")[0] in by_prefix}
    return sorted(out)


# The probe loaded in place of each piece has every element equal to a bf16 value of its own,
# 0x3F81 + k, which is 1.0078125 and up, finite and exact in fp32. So each row of the parameter
# tells piece_rows which piece wrote it.
_PROBE_BITS, _PROBES = 0x3F81, 0x7F7F - 0x3F81


def _probe(index: int, shape, dtype: str, device) -> torch.Tensor:
    if not getattr(torch, dtype).is_floating_point:  # No stacked parameter is written from these.
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    value = torch.tensor(_PROBE_BITS + index % _PROBES, dtype=torch.int16).view(torch.bfloat16).item()
    return torch.full(shape, value, dtype=getattr(torch, dtype), device=device)


def piece_rows(
    model: torch.nn.Module, sent: list, targets: list[list[str]], whole=(), values_only=()
) -> tuple[dict[int, int], list[str], list[str]]:
    """Find where each piece of a parameter written from several sent tensors lands in it.

    Examples are q/k/v into qkv_proj, gate and up, and each expert's tensors into a fused w13 or w2. Call it
    right after exact_targets, with that function's arguments and answer: exact_targets loaded each piece
    through the model's own `load_weights` as its own constant, and this reads back which rows of the
    parameter hold that constant, seeing the parameter as the fingerprint does, [rows, last dim].

    Return three things: {sent index: the dim-0 row the piece starts at}, for _fingerprint_sums' row_offset;
    the parameters whose pieces were all placed, compared element by element in their place like a `whole`
    one; and the parameters compared by their values alone, which are `values_only` and any whose pieces do
    not each land on one block of whole rows.
    """
    params = dict(model.named_parameters())
    pieces: dict[str, list[int]] = {}
    for index, names in enumerate(targets):
        for n in names:
            pieces.setdefault(n, []).append(index)
    skip = set(whole) | set(values_only)
    stacked = {
        n: idx for n, idx in pieces.items() if n in params and n not in skip and not any(sent[i][3] for i in idx)
    }
    at_start = {i for n in whole for i in pieces.get(n, ())}  # Also written whole into another, so at row 0.
    rows: dict[int, int] = {}
    placed, by_value = [], set(values_only) & params.keys()
    for name, idx in stacked.items():
        found = _rows_of_pieces(params[name], idx, sent)
        if found is None or any(rows.get(i, 0 if i in at_start else r) != r for i, r in found.items()):
            by_value.add(name)
            continue
        rows.update(found)
        placed.append(name)
    return rows, sorted(placed), sorted(by_value)


@torch.no_grad()
def _rows_of_pieces(param: torch.Tensor, indices: list[int], sent: list) -> dict[int, int] | None:
    """Return {sent index: its dim-0 row offset} for the pieces `indices` of `param`, or None.

    Each piece must be found as one block of whole rows holding its probe. Return None if any piece is not,
    such as a piece with another last dim or one that vLLM lays out again.
    """
    columns = _columns(param)
    view = param.detach().reshape(-1, columns)
    codes = torch.full((view.shape[0],), -1, dtype=torch.int64)
    step = max(1, _FINGERPRINT_CHUNK // columns)
    for start in range(0, view.shape[0], step):
        chunk = view[start : start + step]
        first = chunk[:, :1]
        same = (chunk == first).all(1)
        bits = first[:, 0].to(torch.bfloat16).view(torch.int16).to(torch.int64) - _PROBE_BITS
        codes[start : start + step] = torch.where(same & (bits >= 0) & (bits < _PROBES), bits, -1).cpu()
    out = {}
    for index in indices:
        _, _, shape, _ = sent[index]
        piece = torch.empty(shape, device="meta")
        if _columns(piece) != columns:
            return None
        at = (codes == index % _PROBES).nonzero().flatten()
        count = piece.numel() // columns
        if len(at) != count or count == 0 or int(at[-1] - at[0]) != count - 1:
            return None
        per_row = math.prod(piece.shape[1:-1]) if piece.dim() >= 2 else 1
        if int(at[0]) % per_row:
            return None
        out[index] = int(at[0]) // per_row
    return out


def probed_parameters(sent: list, targets: list[list[str]]) -> list[str]:
    """Return the parameters exact_targets loaded a probe into.

    Those are the parameters written by any sent tensor except a direct-loader block, which is copied, not
    probed.
    """
    return sorted({n for (_, _, _, block), names in zip(sent, targets, strict=True) if not block for n in names})


def sent_fingerprints(tensors, casts: dict, rows: dict | None = None) -> list:
    """Fingerprint (name, tensor) pairs in send order as the trainer's half does.

    Each gets its held_fingerprint_sums at the row piece_rows placed it at in its parameter.
    """
    rows = rows or {}
    return [held_fingerprint_sums(t, casts.get(i), rows.get(i, 0)).tolist() for i, (_, t) in enumerate(tensors)]


def as_held(tensors, casts: dict):
    """Yield the tensors the trainer sends, each cast to the dtype vLLM holds it in, per exact_targets' `casts`."""
    for index, (_, tensor) in enumerate(tensors):
        yield held_as(tensor, casts.get(index))


def held_as(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """Cast `tensor` to `dtype`, the name of the torch dtype vLLM holds it in; None keeps its own."""
    return tensor.to(getattr(torch, dtype)) if dtype else tensor


# exact_targets' cast for an expert block that vLLM holds in FP8: "fp8_blocks:<shards>".
FP8_BLOCKS = "fp8_blocks:"


def held_fingerprint_sums(tensor: torch.Tensor, held: str | None, row_offset: int = 0) -> torch.Tensor:
    """Return the fingerprint sums of what vLLM holds of a sent tensor, given exact_targets' cast `held`.

    For a plain cast, that is the tensor in that dtype, as an int64 tensor of 3. For an expert block that
    vLLM holds in FP8, it is vLLM's own quantization of it from fp8_experts.fp8_reference, as
    [[weight's], [scales']]. `row_offset` is the row of the parameter it lands at, from piece_rows.
    """
    if held and held.startswith(FP8_BLOCKS):
        quantized = fp8_reference(tensor.to(torch.bfloat16), int(held.removeprefix(FP8_BLOCKS)))
        return torch.stack(exact_fingerprint_sums(quantized))
    return _fingerprint_sums(held_as(tensor, held), row_offset)


def quantized_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[str]:
    """Return the names of FP8 expert layers' weights and scales that vLLM's own loader writes from what is sent.

    These exclude the direct loader's blocks. vLLM's loader quantizes each expert from its pieces, so these
    are not compared with the trainer's. benchmark.py's loaders_agree instead compares them with the direct
    loader's, which the exact check proves.
    """
    return _parameter_names(_fp8_layers_by_vllms_loader(model, sent))


def fp8_parameter_names(model: torch.nn.Module) -> set[str]:
    """Return the names of the weights and scales of every expert layer vLLM serves in FP8."""
    return set(_parameter_names(_fp8_layers(model)))


def _fp8_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Return (module prefix, layer) of each expert layer vLLM serves in FP8."""
    return [(prefix, m) for prefix, m in model.named_modules() if fp8_scales(m, "w13_weight") is not None]


def _fp8_layers_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[tuple[str, torch.nn.Module]]:
    """Return (module prefix, layer) of each FP8 expert layer that no direct-loader block is sent to."""
    blocks = {name.rpartition(".")[0] for name, _, _, block in sent if block}
    return [(prefix, layer) for prefix, layer in _fp8_layers(model) if layer.layer_name not in blocks]


def _parameter_names(layers: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """Return the full names of the layers' own parameters, which may sit a module or two below the layer's name."""
    return [f"{prefix}.{n}" for prefix, layer in layers for n, _ in layer.named_parameters(recurse=False)]


def exact_problems(
    model: torch.nn.Module,
    targets: list[list[str]],
    sent: list[list[int]],
    values_only=(),
    whole=(),
    fingerprints=None,
    unchecked=(),
) -> tuple[int, list[str]]:
    """Compare each parameter's fingerprint with the sum of those of the tensors written into it.

    `sent` holds the trainer's exact_fingerprint of each tensor, in `targets`' order. Parameters in
    `values_only`, from exact_targets, are compared by their values alone. Parameters in `whole`, written
    whole from one tensor or from pieces the trainer fingerprinted at their rows per piece_rows, are compared
    element by element in place. `fingerprints` computes the parameters' fingerprints; it is
    exact_fingerprints or a HeldFingerprints. A sent tensor that vLLM holds as several parameters, such as an
    FP8 expert block's weight and scales, comes with one fingerprint per target. Parameters in `unchecked`
    are skipped. Return (parameters checked, a list of problems).
    """
    if len(sent) != len(targets):
        raise ValueError(f"{len(sent)} fingerprints for the {len(targets)} tensors exact_check_prepare was given")
    want: dict[str, list[int]] = {}
    for sums, names in zip(sent, targets, strict=True):
        per_target = sums if sums and isinstance(sums[0], list) else [sums] * len(names)
        for name, target_sums in zip(names, per_target, strict=True):  # Sum the pieces of a stacked parameter.
            total = want.setdefault(name, [0, 0, 0])
            want[name] = [(a + b) % FINGERPRINT_MODULUS for a, b in zip(total, target_sums, strict=True)]
    params = dict(model.named_parameters())
    derived = set(derived_parameters(model)) | set(unchecked)
    values_only, whole = set(values_only), set(whole)
    checked = checked_parameters(model, targets)
    held = dict(zip(checked, (fingerprints or exact_fingerprints)([params[n] for n in checked]), strict=True))
    problems = []
    for name in params:
        if name not in want and name not in derived:
            problems.append(f"{name}: no tensor the trainer sends is written into it")
        elif name not in want:
            continue
        elif name in values_only and held[name][0] == want[name][0]:
            continue
        elif held[name][:2] != want[name][:2] or (name in whole and held[name][2] != want[name][2]):
            problems.append(
                f"{name}: "
                + (
                    "the values sent, in another layout (transposed or permuted)"
                    if held[name][0] == want[name][0]
                    else "not what the trainer sent"
                )
            )
    return len(params) - len(set(unchecked) & params.keys()), problems


def checked_parameters(model: torch.nn.Module, targets: list[list[str]]) -> list[str]:
    """Return the parameters exact_problems fingerprints, those some sent tensor is written into.

    exact_problems reports any other parameter without fingerprinting it.
    """
    written = {n for names in targets for n in names}
    return [n for n, _ in model.named_parameters() if n in written]


def derived_parameters(model: torch.nn.Module) -> list[str]:
    """Return the parameters no sent tensor writes, which vLLM computes from others after loading.

    These belong to attention layers that process their weights after the load, such as MLA's absorbed
    W_UK_T and W_UV derived from kv_b_proj. direct_load_finish runs that processing, as vLLM's loader does.
    The exact check proves their sources, and the logprob gate proves their use.
    """
    is_deferred_attention_layer = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")

    return [
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if is_deferred_attention_layer(module)
        for name, _ in module.named_parameters(recurse=False)
    ]


def _held_elsewhere(sent_name: str, experts: torch.nn.Module | None) -> bool:
    """Return whether `sent_name` is the checkpoint tensor of an expert that another engine holds.

    `experts` is the fused expert layer `sent_name` is written into, or None if it is not an expert layer.
    Checkpoint names look like `...experts.<id>....`. vLLM's loader skips such tensors, so they add nothing
    here.
    """
    found = _ONE_EXPERT.search(sent_name)
    return experts is not None and found is not None and int(found.group(1)) not in local_expert_ids(experts)


# The exact check's fingerprint; exact_fingerprint says what it is and what it guarantees.
# It is three sums of each element's mixed bits: `plain`, which does not depend on where an
# element sits; `by_column`, weighted by its column; and `by_position`, weighted by its column
# and its row. The arithmetic is exact in int64, so the trainer's GPU, an engine's GPU and a
# CPU give the same sums.
FINGERPRINT_MODULUS = 1 << 62
_INDEX_LIMIT = 1 << 30  # Every row and column index below this has a weight of its own.
_MASK30, _MASK31, _MASK32, _MASK62 = _INDEX_LIMIT - 1, (1 << 31) - 1, (1 << 32) - 1, FINGERPRINT_MODULUS - 1
_COLUMN_SEED, _ROW_SEED = 0x9E3779B9, 0x27D4EB2F


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Apply lowbias32, a bijection, to int64 values below 2**32; products wrap, but the low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix30(x: torch.Tensor) -> torch.Tensor:
    """Mix int64 values below 2**30 with a bijection.

    Each step is invertible: an xor with the value shifted right, or a product by an odd number modulo 2**30.
    """
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK30
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK30
    return x ^ (x >> 15)


def _weights(index: torch.Tensor, seed: int) -> torch.Tensor:
    """Return the weight of each row or column `index`, int64 below 2**30.

    The weight is 2 * mix30((index + seed) mod 2**30) + 1: odd, below 2**31, and different for every index,
    because index -> (index + seed) mod 2**30 and mix30 are both bijections of the integers below 2**30.
    """
    return _mix30((index.to(torch.int64) + seed) & _MASK30) * 2 + 1


def _times62(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Return a * w modulo 2**62 exactly, for int64 a below 2**62 and w below 2**31.

    `a` is split at bit 31, so each partial product is below 2**62 and their sum below 2**63.
    """
    return (((((a >> 31) * w) & _MASK31) << 31) + (a & _MASK31) * w) & _MASK62


def _sum62(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Return the sum of `a` along `dim`, or over all of it if None, modulo 2**62 exactly.

    Each value is int64 below 2**63, with at most 2**31 of them summed. The bits above 31 and those below are
    summed apart, so each sum stays below 2**63.
    """
    high, low = (a >> 31).sum(dim), (a & _MASK31).sum(dim)
    return (((high & _MASK31) << 31) + (low & _MASK62)) & _MASK62


def exact_fingerprints(tensors) -> list[list[int]]:
    """Return exact_fingerprint of each tensor, waiting for the device once."""
    sums = exact_fingerprint_sums(tensors)
    return torch.stack(sums).cpu().tolist() if sums else []


class HeldFingerprints:
    """Compute exact_fingerprints of tensors that stay in place between syncs, from one CUDA graph.

    The tensors are an engine's or a trainer's parameters. A model of hundreds of tensors spends more time
    launching the few small kernels each one needs than the GPU spends in them, so a graph replays every
    launch at once. The graph reads the tensors where they were when it was captured. It is captured once the
    same tensors at the same addresses come twice in a row, and captured again once moved tensors come twice
    in a row; a loader that allocates new tensors each time is fingerprinted eagerly.

    Each tensor may be cast first, through the dtypes in `casts` in order, and may be a shard starting at a
    row of a larger tensor, per `row_offsets`; see _fingerprint_sums. A call with a tensor that needs a cast
    or a contiguous copy runs eagerly, because a graph would keep those copies' memory for as long as it
    lives. `start` runs the kernels on their own CUDA stream, beside whatever the process does next, and
    returns a function that waits for them.
    """

    def __init__(self) -> None:
        self._last = None  # The previous call's tensors, as (address, shape, stride, dtype, offset) each.
        self._graph = self._sums = self._stream = None

    def __call__(self, tensors, row_offsets=None, casts=None) -> list[list[int]]:
        return self.start(tensors, row_offsets, casts)()

    def start(self, tensors, row_offsets=None, casts=None):
        """Launch the fingerprints; return a function that waits for them and reads them back."""
        tensors = list(tensors)
        row_offsets = list(row_offsets or [0] * len(tensors))
        casts = [tuple(c) for c in (casts or [()] * len(tensors))]

        def sums() -> torch.Tensor:
            out = []
            for tensor, offset, dtypes in zip(tensors, row_offsets, casts, strict=True):
                for dtype in dtypes:
                    tensor = tensor.to(dtype)
                out.append(_fingerprint_sums(tensor, offset))
            return torch.stack(out)

        if not tensors or not all(t.is_cuda for t in tensors):
            done = sums().tolist() if tensors else []
            return lambda: done
        graphed = not any(casts) and all(t.is_contiguous() for t in tensors)
        key = (
            [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, o) for t, o in zip(tensors, row_offsets, strict=True)]
            if graphed
            else None
        )
        self._stream = self._stream or torch.cuda.Stream(tensors[0].device)
        if key is None or key != self._last:  # New tensors, or ones a graph should not hold: run eagerly.
            self._last, self._graph, self._sums = key, None, None
        elif self._graph is None:  # The same tensors a second time: capture.
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Not torch.cuda.graph(): it empties PyTorch's cache first, and the
            # trainer would allocate its 4 GiB send buffer again next sync.
            # "thread_local" because vLLM's own threads may use CUDA meanwhile.
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured = sums()
                finally:
                    graph.capture_end()
            self._graph, self._sums = graph, captured
        self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # Wait for what wrote them.
        with torch.cuda.stream(self._stream):
            if self._graph is not None:
                self._graph.replay()
                out = self._sums
            else:
                out = sums()
            ready = torch.cuda.Event()
            ready.record(self._stream)

        def result() -> list[list[int]]:
            ready.synchronize()
            return out.cpu().tolist()

        return result


def exact_fingerprint_sums(tensors) -> list[torch.Tensor]:
    """Return exact_fingerprint of each tensor as an int64 tensor of 3 on its device, without waiting."""
    return [_fingerprint_sums(t) for t in tensors]


def exact_fingerprint(tensor: torch.Tensor) -> list[int]:
    """Return [plain, by_column, by_position] of a tensor's elements, each modulo FINGERPRINT_MODULUS, 2**62.

    The tensor is seen as [rows, columns]. Its columns are its last dim, or one column for a 1-D tensor, and
    its rows are all the dims before. Rows are counted from the first row of the whole tensor that a shard or
    a piece is part of; see `row_offset` of _fingerprint_sums. Each element's bits go through lowbias32, a
    bijection of 32-bit integers; an 8-byte element's bits are first folded to 32. So
    m = mix32(bits ^ 0x5BD1E995) is below 2**32 and different for different bits. Then, modulo 2**62:

        plain       = sum of m
        by_column   = sum of m * cw(column)
        by_position = sum of m * cw(column) * rw(row)

    cw and rw come from _weights, each with its own seed, and cw = 1 for a tensor of one column. The weight
    is w(i) = 2 * mix30((i + seed) mod 2**30) + 1, where mix30 is a bijection of the integers below 2**30,
    so every row index and every column index below 2**30 has an odd weight below 2**31 of its own. A tensor
    with more rows or columns is refused. Every intermediate stays below 2**63, through m * cw, _times62 and
    _sum62, so the arithmetic is exact on any device, with no overflow.

    What it guarantees:

    - Sums add up. An element's three terms depend only on its bits, its column and its row in the whole.
      So the sums of shards, each a block of dim-0 rows at its row_offset, and of pieces stacked on dim 0,
      each at the rows it lands at, add up modulo 2**62 to the whole's, for all three sums. plain and
      by_column do not depend on the row, so the pieces' sums add up to the stack's wherever they land.

    - Exchanging two elements with different bits always changes a sum. Say u sits at (i, a) and v at
      (j, b), with m(u) != m(v). For a != b, by_column changes by (cw(a) - cw(b)) * (m(v) - m(u)).
      cw(a) - cw(b) is twice the difference of two distinct mix30 values below 2**30, so it is nonzero with
      at most 1 + 29 factors of 2. m(v) - m(u) is nonzero and smaller than 2**32 in size, so it has at most
      31. The product has at most 61, so it is no multiple of 2**62. For a == b, so i != j, by_position
      changes by cw(a) * (rw(i) - rw(j)) * (m(v) - m(u)) with cw(a) odd, and the same argument holds.
      Likewise, exchanging two rows that differ in one element changes by_position, and exchanging two
      columns that differ in one element changes by_column.

    - Other rearrangements can go unseen, with small probability. Exchanging two rows or columns that differ
      in several elements, exchanging blocks of rows, or transposing changes a sum by many such products
      added up, and those can cancel modulo 2**62. With fixed constants this is a checksum, not a
      cryptographic hash: data crafted against them can cancel. For other data, take the mixes of different
      bit patterns as independent uniform 32-bit values. The change is a sum over the bit patterns of
      A * m(pattern), where A is the pattern's weights where it is now minus its weights where it was. If
      some A is not a multiple of 2**62, say it has t factors of 2, then given the other mixes, at most
      max(1, 2**(t - 30)) of the 2**32 values of that pattern's mix make the change vanish. That is a chance
      of at most 2**-min(32, 62 - t). A pattern that one row holds once and the other not at all has t <= 30.

    - It compares bits. +0.0 and -0.0 differ, as do two NaNs with different payloads. Two 8-byte elements
      whose bits fold to the same 32 bits do not differ.
    """
    return _fingerprint_sums(tensor).tolist()


@torch.no_grad()
def _fingerprint_sums(tensor: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """Return exact_fingerprint as an int64 tensor of 3 on the tensor's device.

    On a GPU, 1-, 2- and 4-byte elements take one pass of one kernel, _fingerprint_kernel; otherwise torch
    computes it in pieces of bounded size. `row_offset` is the dim-0 row where this tensor starts in the
    tensor it is a shard of, so that the shards' sums add up to the whole's.
    """
    if triton is not None and tensor.is_cuda and tensor.element_size() in (1, 2, 4) and tensor.numel():
        return fingerprint_sums_triton(tensor, row_offset=row_offset)
    flat = tensor.detach()
    columns = _columns(flat)
    rows = flat.contiguous().reshape(-1, columns)
    first_row = _first_row(tensor, row_offset, rows.shape[0])
    bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    unsigned = (1 << (8 * rows.element_size())) - 1 if rows.element_size() < 8 else -1
    column_weight = _weights(torch.arange(columns, device=rows.device), _COLUMN_SEED) if columns > 1 else 1
    sums = torch.zeros(3, dtype=torch.int64, device=rows.device)
    step = max(1, _FINGERPRINT_CHUNK // columns)
    for start in range(0, rows.shape[0], step):
        bits = rows[start : start + step].view(bits_dtype).to(torch.int64) & unsigned
        if rows.element_size() == 8:  # Fold 64-bit patterns into 32.
            bits = (bits ^ (bits >> 32)) & _MASK32
        plain = _mix32(bits ^ 0x5BD1E995)  # The constant makes zeros count too.
        by_column = plain * column_weight  # Below 2**32 * 2**31.
        first = first_row + start
        row_weight = _weights(torch.arange(first, first + bits.shape[0], device=rows.device), _ROW_SEED)
        row_sums = _sum62(by_column, 1)  # Each row's by_column; its by_position is that times the row's weight.
        sums[0] = (sums[0] + plain.sum()) & _MASK62
        sums[1] = (sums[1] + _sum62(row_sums)) & _MASK62
        sums[2] = (sums[2] + _sum62(_times62(row_sums, row_weight))) & _MASK62
    return sums


def _first_row(tensor: torch.Tensor, row_offset: int, rows: int | None = None) -> int:
    """Return the fingerprint row of the first element of a shard that starts at `row_offset` on dim 0.

    The fingerprint sees the tensor as [rows, columns]. If the shard's `rows` is given, raise if a row or a
    column would have no weight of its own.
    """
    first = row_offset * math.prod(tensor.shape[1:-1]) if tensor.dim() >= 2 else row_offset
    if rows is not None and not (0 <= first and first + rows <= _INDEX_LIMIT and _columns(tensor) <= _INDEX_LIMIT):
        raise ValueError(
            f"cannot fingerprint a tensor of shape {tuple(tensor.shape)} at row {first}: the fingerprint "
            f"tells apart rows and columns below {_INDEX_LIMIT}"
        )
    return first


def _columns(tensor: torch.Tensor) -> int:
    """Return the fingerprint's column count: the last dim's size, or 1 for a 1-D or empty-last-dim tensor."""
    return tensor.shape[-1] if tensor.dim() >= 2 and tensor.shape[-1] > 0 else 1


def fingerprint_sums_triton(tensor: torch.Tensor, block: int = 8192, row_offset: int = 0) -> torch.Tensor:
    """Compute _fingerprint_sums in one pass of a Triton kernel, reading the tensor once.

    Each program mixes a tile of `block` elements, a power of 2, of the tensor seen as [rows, columns], with
    the torch code's arithmetic, and writes its three partial sums, each below 2**62. A second kernel adds
    those up. A 2-D grid gives each element its row and column without a division. On CPU it runs only under
    TRITON_INTERPRET=1, which is how the tests check it against the torch code.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    columns = _columns(tensor)
    rows = flat.numel() // columns
    first_row = _first_row(tensor, row_offset, rows)
    bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[flat.element_size()])
    block_c = min(triton.next_power_of_2(columns), block)
    block_r = block // block_c
    grid = (triton.cdiv(rows, block_r), triton.cdiv(columns, block_c))
    partial = torch.empty(grid[0] * grid[1], 3, dtype=torch.int64, device=flat.device)
    _fingerprint_kernel[grid](
        bits,
        partial,
        rows,
        columns,
        first_row,
        ELEMENT_BITS=8 * flat.element_size(),
        SALTED=columns > 1,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    sums = torch.empty(3, dtype=torch.int64, device=flat.device)
    _sum_partials_kernel[(3,)](partial, sums, partial.shape[0], BLOCK=1024)
    return sums


# The kernel's arithmetic is the torch code's, step for step: _mix32, _mix30,
# _weights, _times62 and _sum62 each have a twin here that computes the same
# values. The twins use uint32 where the torch code masks to 32 or 30 bits,
# because wrapping modulo 2**32 gives the same low bits, and int64 elsewhere.
if triton is not None:

    @triton.jit
    def _mix32_triton(x):  # _mix32 on uint32; its products wrap as `& _MASK32` does in _mix32.
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _mix30_triton(x):  # _mix30 on uint32 below 2**30: a product modulo 2**32, then masked to 30 bits.
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0x3FFFFFFF
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & 0x3FFFFFFF
        return x ^ (x >> 15)

    @triton.jit
    def _weights_triton(index, seed):  # _weights as uint32, below 2**31.
        return _mix30_triton((index.to(tl.uint32) + seed) & 0x3FFFFFFF) * 2 + 1

    @triton.jit
    def _times62_triton(a, w):  # _times62: int64 a below 2**62, int64 w below 2**31
        return (((((a >> 31) * w) & 0x7FFFFFFF) << 31) + (a & 0x7FFFFFFF) * w) & 0x3FFFFFFFFFFFFFFF

    @triton.jit
    def _sum62_triton(a, axis):  # _sum62 along `axis`
        high = tl.sum(a >> 31, axis=axis)
        low = tl.sum(a & 0x7FFFFFFF, axis=axis)
        return (((high & 0x7FFFFFFF) << 31) + (low & 0x3FFFFFFFFFFFFFFF)) & 0x3FFFFFFFFFFFFFFF

    @triton.jit
    def _fingerprint_kernel(
        bits_ptr,
        partial_ptr,
        rows,
        columns,
        first_row,
        ELEMENT_BITS: tl.constexpr,
        SALTED: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        column = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        inside = (row[:, None] < rows) & (column[None, :] < columns)
        raw = tl.load(bits_ptr + row[:, None] * columns + column[None, :], mask=inside, other=0)
        if ELEMENT_BITS == 8:
            bits = raw.to(tl.uint8, bitcast=True).to(tl.uint32)
        elif ELEMENT_BITS == 16:
            bits = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        else:
            bits = raw.to(tl.uint32, bitcast=True)
        plain = _mix32_triton(bits ^ 0x5BD1E995)
        if SALTED:
            column_weight = _weights_triton(column, 0x9E3779B9)
        else:
            column_weight = tl.full([BLOCK_C], 1, dtype=tl.uint32)
        zero = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int64)
        by_column = tl.where(inside, plain.to(tl.int64) * column_weight.to(tl.int64)[None, :], zero)
        row_weight = _weights_triton(row + first_row, 0x27D4EB2F).to(tl.int64)
        row_sums = _sum62_triton(by_column, 1)  # This tile's part of each row's by_column.
        at = partial_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
        tl.store(at + 0, tl.sum(tl.sum(tl.where(inside, plain.to(tl.int64), zero), axis=1), axis=0))
        tl.store(at + 1, _sum62_triton(row_sums, 0))
        tl.store(at + 2, _sum62_triton(_times62_triton(row_sums, row_weight), 0))

    @triton.jit
    def _sum_partials_kernel(partial_ptr, sums_ptr, tiles, BLOCK: tl.constexpr):
        """Sum column k of `partial`, [tiles, 3] with each value below 2**62, modulo 2**62 in program k.

        This adds up the tiles as the torch code adds up its chunks' sums.
        """
        k = tl.program_id(0)
        total = tl.zeros([BLOCK], dtype=tl.int64)  # Each lane's share, below 2**62.
        for start in range(0, tiles, BLOCK):
            tile = start + tl.arange(0, BLOCK)
            total = (total + tl.load(partial_ptr + tile * 3 + k, mask=tile < tiles, other=0)) & 0x3FFFFFFFFFFFFFFF
        tl.store(sums_ptr + k, _sum62_triton(total, 0))
