# SPDX-License-Identifier: Apache-2.0
"""The exact check's engine half, and its fingerprint: proof that every DP
engine holds, bit for bit, what the trainer rank on its GPU sent.

`ExactCheckWorker` is the direct loader's worker extension (direct_load.py)
with the exact check's calls added; rlhf_ipc_fsdp_ep.py starts the server with
`--worker-extension-cls exact_check_engine.ExactCheckWorker`. Its calls, through
`/collective_rpc`, on every engine:

    exact_check_prepare(sent)   once: which parameters each sent tensor is written into, at which rows
    exact_check_start()         after a sync: fingerprint what the engine holds, beside serving
    exact_check(expected)       compare with the trainer's fingerprints; raise naming what differs
    direct_load_fingerprint(a)  'store' / 'compare' every parameter (benchmark.py's loaders_agree)

The trainer's half (checks.FingerprintedSource) fingerprints what each rank
sent with the same function (`exact_fingerprint`), so the two sums meet
exactly: integer arithmetic, the same on a GPU and a CPU.
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

try:  # vLLM's GPU builds depend on Triton; without it, the torch code fingerprints everything
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_ONE_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # one expert's tensor in checkpoint form: its id


class ExactCheckWorker(DirectLoadWorker):
    """DirectLoadWorker with the exact check's calls; every method runs on every engine."""

    def direct_load_start(self, in_place: str | dict = "") -> dict:
        self._exact_started = None  # fingerprints of what the engine held before this sync: no longer of use
        if getattr(self, "_profile_path", None) and getattr(self, "_profiler", None) is None:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()
        return super().direct_load_start(in_place)

    def profile_next_sync(self, path: str) -> dict:
        """Profile this engine's part of the next direct sync (Python, with cProfile); its top functions by
        cumulative time go to `path` with the engine's DP rank appended, once the sync is finished."""
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
        """'store': remember a fingerprint of every parameter. 'compare':
        fingerprint again and raise, naming them, if any parameter differs
        from the stored one (so a mismatch on any DP engine fails the call)."""
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
        """Learn which of this engine's parameters each tensor the trainer
        sends is written into (`exact_targets`; `sent`: JSON [[name, dtype,
        shape, is_expert_block], ...], the source's metadata in send order).
        Also where each piece of a parameter written from several tensors
        lands in it (`piece_rows`: "rows", what the trainer fingerprints each
        piece at). Before a full sync: it leaves every parameter it probes
        zero, until the sync overwrites it."""
        model, sent = self.model_runner.get_model(), json.loads(sent)
        self._exact_targets, casts, self._exact_values_only, whole = exact_targets(model, sent, self.vllm_config)
        rows, placed, by_value = piece_rows(model, sent, self._exact_targets, whole, self._exact_values_only)
        self._exact_whole = sorted(set(whole) | set(placed))  # every element compared in its place
        with torch.no_grad():  # the probes' constants (up to 3e38) would overflow what it serves before the sync
            params = dict(model.named_parameters())
            for name in probed_parameters(sent, self._exact_targets):
                params[name].zero_()
        self._exact_unchecked = quantized_by_vllms_loader(model, sent)
        self._held_fingerprints, self._exact_started = HeldFingerprints(), None
        exact_fingerprints(p for _, p in model.named_parameters())  # Triton compiles its kernels now, not in a sync
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
        """Start fingerprinting what this engine holds, after a sync, on a CUDA
        stream of its own, beside whatever it serves next; exact_check waits
        for it (or, if this was not called, fingerprints then)."""
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        names = checked_parameters(model, targets)
        self._exact_started = self._held_fingerprints.start(params[n] for n in names)
        return {"parameters": len(names)}

    def exact_check(self, expected: str) -> dict:
        """Prove that this engine holds exactly what the trainer rank on its
        GPU sent (`exact_problems`; `expected`: JSON {gpu_uuid: [[plain,
        by_column, by_position], ...]} in the order exact_check_prepare was given). Raise,
        naming this DP engine and the parameters that differ, if any does."""
        start = time.perf_counter()
        started, self._exact_started = getattr(self, "_exact_started", None), None  # used once, or not at all
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        uuid = _gpu_uuid(next(model.parameters()).device)
        per_rank = json.loads(expected)
        sent = per_rank[uuid] if uuid in per_rank else _no_trainer_rank(uuid, list(per_rank))
        dp_rank = self.vllm_config.parallel_config.data_parallel_rank

        def fingerprints(tensors):  # those exact_check_start launched, of the same parameters; else now
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
                fp8_experts._KERNEL_AGREES[next(model.parameters()).device] = False  # from the next sync on
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


_FINGERPRINT_CHUNK = 1 << 24  # elements per step: bounds the temporary memory


def _write_profile(profiler, path: str) -> None:
    """The profile's 60 functions of most cumulative time, as text."""
    import io
    import pstats

    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(60)
    with open(path, "w") as f:
        f.write(out.getvalue())


def _fingerprint(tensor: torch.Tensor) -> str:
    """A checksum of a tensor's shape, dtype and every element in its place
    (exact_fingerprint), computed on its device: for comparing an engine's
    parameters with themselves (direct_load_fingerprint)."""
    return f"{tuple(tensor.shape)}:{tensor.dtype}:{':'.join(map(str, exact_fingerprint(tensor)))}"


def exact_targets(
    model: torch.nn.Module, sent: list, vllm_config
) -> tuple[list[list[str]], dict[int, str], list[str], list[str]]:
    """For each tensor the trainer sends ([name, dtype, shape, is an expert
    block of the direct loader], in send order), the parameters of `model` it
    is written into: found by loading it once, as a constant of its own
    (_probe, which piece_rows then reads back), through the model's own
    `load_weights` (whatever the family stacks or renames), or, for an
    expert block, its layer's fused parameter. One expert's tensor of an
    expert another engine holds is written nowhere here. Also {index: dtype}
    of the tensors vLLM holds in another dtype than they are sent in (e.g. a router kept in
    fp32): the trainer fingerprints those cast, as vLLM's loader casts them;
    the parameters to compare by value alone (_relaid_out); and those written
    whole from one tensor of their shape, compared element by element."""
    set_current_vllm_config = internal("vllm.config", "set_current_vllm_config")

    device = next(model.parameters()).device
    layers = _expert_layers(model)  # by vLLM's layer name
    where = {id(module): prefix for prefix, module in model.named_modules()}  # the parameters' prefix
    by_prefix = {where[id(layer)]: layer for layer in layers.values()}
    targets, quantized = [], {}
    # (vLLM names an expert layer as the checkpoint does, e.g. model.layers.0.mlp.experts; its
    # parameters may sit deeper, e.g. model.layers.0.mlp.experts.routed_experts.w13_weight)
    unchecked_layers = tuple(f"{layer.layer_name}." for _, layer in _fp8_layers_by_vllms_loader(model, sent))
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        for index, (name, dtype, shape, block) in enumerate(sent):
            if block:
                layer_name, _, tensor_name = name.rpartition(".")
                layer, param_name = layers[layer_name], EXPERT_TENSORS[tensor_name]
                targets.append([f"{where[id(layer)]}.{param_name}"])
                if fp8_scales(layer, param_name) is not None:  # FP8: its weight and its scales, each whole
                    targets[-1].append(f"{targets[-1][0]}_scale_inv")
                    quantized[index] = f"{FP8_BLOCKS}{fp8_shards(layer, param_name)}"
                continue
            if unchecked_layers and name.startswith(unchecked_layers):  # an FP8 expert layer's: not probed
                targets.append([])
                continue
            # (its own constant, not zeros: piece_rows reads back where each piece landed)
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
    """The fused-expert parameters vLLM's own loader fills from a FUSED
    checkpoint tensor, or from GPT-OSS's per-expert tensors: it lays those
    out its own way (GPT-OSS: [E, H, 2I] transposed), so only their values
    can be compared. The direct loader's blocks it copies as they are, and
    other families' per-expert tensors it stacks: those are compared whole."""
    out = set()
    for (name, _, _, block), names in zip(sent, targets, strict=True):
        gpt_oss_expert = re.search(r"\.experts\.\d+\.w(13|2)_(weight|bias)$", name)  # vLLM transposes those
        if block or (_ONE_EXPERT.search(name) and not gpt_oss_expert):
            continue
        out |= {t for t in names if t.rpartition(".")[0] in by_prefix}
    return sorted(out)


# The probe piece_rows loads in place of each piece: every element the same
# bf16 value, its own (0x3F81 + k: 1.0078125 and up, finite, exact in fp32),
# so each row of the parameter tells which piece wrote it.
_PROBE_BITS, _PROBES = 0x3F81, 0x7F7F - 0x3F81


def _probe(index: int, shape, dtype: str, device) -> torch.Tensor:
    if not getattr(torch, dtype).is_floating_point:  # (no stacked parameter is written from those)
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
    value = torch.tensor(_PROBE_BITS + index % _PROBES, dtype=torch.int16).view(torch.bfloat16).item()
    return torch.full(shape, value, dtype=getattr(torch, dtype), device=device)


def piece_rows(
    model: torch.nn.Module, sent: list, targets: list[list[str]], whole=(), values_only=()
) -> tuple[dict[int, int], list[str], list[str]]:
    """Where each piece of a parameter written from several sent tensors
    (q/k/v into qkv_proj, gate/up, each expert's tensors into a fused w13/w2)
    lands in it, read back right after exact_targets (its arguments and
    answer) loaded each piece through the model's own `load_weights` as its
    own constant (_probe): which rows of the parameter (seen as the
    fingerprint sees it: [rows, last dim]) hold that constant. Returns
    ({sent index: the row of the piece's dim 0 it starts at, for
    _fingerprint_sums' row_offset},
    the parameters every piece of which was placed so, compared element by
    element in their place like a `whole` one; those compared by their values
    alone: `values_only` and any whose pieces do not land on whole rows of it,
    in one block each)."""
    params = dict(model.named_parameters())
    pieces: dict[str, list[int]] = {}
    for index, names in enumerate(targets):
        for n in names:
            pieces.setdefault(n, []).append(index)
    skip = set(whole) | set(values_only)
    stacked = {
        n: idx for n, idx in pieces.items() if n in params and n not in skip and not any(sent[i][3] for i in idx)
    }
    at_start = {i for n in whole for i in pieces.get(n, ())}  # a piece also written whole into another: row 0
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
    """{sent index: its dim-0 row offset} for the pieces `indices` of `param`,
    each found as one block of whole rows holding its probe, in order; None
    if any piece is not (a piece with another last dim, one vLLM re-lays out)."""
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
    """The parameters exact_targets loaded a probe into: those any sent tensor
    but a direct-loader block (copied, not probed) is written into."""
    return sorted({n for (_, _, _, block), names in zip(sent, targets, strict=True) if not block for n in names})


def sent_fingerprints(tensors, casts: dict, rows: dict | None = None) -> list:
    """The trainer's half, for tensors in send order (name, tensor): each one's
    held_fingerprint_sums, at the row piece_rows placed it at in its parameter."""
    rows = rows or {}
    return [held_fingerprint_sums(t, casts.get(i), rows.get(i, 0)).tolist() for i, (_, t) in enumerate(tensors)]


def as_held(tensors, casts: dict):
    """The tensors the trainer sends, each cast to the dtype vLLM holds it in
    where that differs (`casts`, from exact_targets): what to fingerprint."""
    for index, (_, tensor) in enumerate(tensors):
        yield held_as(tensor, casts.get(index))


def held_as(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """`tensor` in the dtype vLLM holds it in (`dtype`, a torch dtype's name; None: its own)."""
    return tensor.to(getattr(torch, dtype)) if dtype else tensor


# The cast of an expert block vLLM holds in FP8: "fp8_blocks:<shards>" (exact_targets' casts).
FP8_BLOCKS = "fp8_blocks:"


def held_fingerprint_sums(tensor: torch.Tensor, held: str | None, row_offset: int = 0) -> torch.Tensor:
    """The fingerprint sums of what vLLM holds of a sent tensor (`held`, exact_targets' cast):
    of the tensor in that dtype, an int64 tensor of 3; of an expert block vLLM holds in FP8,
    vLLM's own quantization of it (fp8_experts.fp8_reference), [[weight's], [scales']].
    `row_offset`: the row of the parameter it lands at (piece_rows)."""
    if held and held.startswith(FP8_BLOCKS):
        quantized = fp8_reference(tensor.to(torch.bfloat16), int(held.removeprefix(FP8_BLOCKS)))
        return torch.stack(exact_fingerprint_sums(quantized))
    return _fingerprint_sums(held_as(tensor, held), row_offset)


def quantized_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[str]:
    """The FP8 expert layers' parameters (weights and scales, by name) that vLLM's
    own loader writes from what is sent (not the direct loader's blocks): it
    quantizes each expert from its pieces, so they are not compared with the
    trainer's (benchmark.py's loaders_agree compares them with the direct
    loader's, which the exact check proves)."""
    return _parameter_names(_fp8_layers_by_vllms_loader(model, sent))


def fp8_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters (by name) of every expert layer vLLM serves in FP8: its weights and scales."""
    return set(_parameter_names(_fp8_layers(model)))


def _fp8_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(module prefix, layer) of each expert layer vLLM serves in FP8."""
    return [(prefix, m) for prefix, m in model.named_modules() if fp8_scales(m, "w13_weight") is not None]


def _fp8_layers_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[tuple[str, torch.nn.Module]]:
    """(module prefix, layer) of each FP8 expert layer that no direct-loader block is sent to."""
    blocks = {name.rpartition(".")[0] for name, _, _, block in sent if block}
    return [(prefix, layer) for prefix, layer in _fp8_layers(model) if layer.layer_name not in blocks]


def _parameter_names(layers: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """The full names of the layers' own parameters (vLLM's may sit a module or two below the layer's name)."""
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
    """(parameters checked, what is wrong with them): each parameter's
    fingerprint against the sum of those of the tensors written into it
    (`sent`: the trainer's exact_fingerprint of each, in `targets`' order);
    for those in `values_only` (exact_targets), their values alone; for
    those in `whole` (written whole from one tensor, or from pieces the
    trainer fingerprinted at their rows: piece_rows), every element in its
    place. `fingerprints` takes the parameters' (exact_fingerprints, or a
    HeldFingerprints). A sent tensor
    vLLM holds as several parameters (an FP8 expert block: weight, scales)
    comes with one fingerprint per target; `unchecked` are skipped."""
    if len(sent) != len(targets):
        raise ValueError(f"{len(sent)} fingerprints for the {len(targets)} tensors exact_check_prepare was given")
    want: dict[str, list[int]] = {}
    for sums, names in zip(sent, targets, strict=True):
        per_target = sums if sums and isinstance(sums[0], list) else [sums] * len(names)
        for name, target_sums in zip(names, per_target, strict=True):  # a stacked parameter's: its pieces' summed
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
    """The parameters exact_problems fingerprints: those a sent tensor is
    written into (one that none is, it names without a fingerprint)."""
    written = {n for names in targets for n in names}
    return [n for n, _ in model.named_parameters() if n in written]


def derived_parameters(model: torch.nn.Module) -> list[str]:
    """Parameters no sent tensor writes, which vLLM computes from others after
    loading: those of attention layers that process their weights after the
    load (MLA's absorbed W_UK_T and W_UV, from kv_b_proj; direct_load_finish
    runs that processing, as vLLM's loader does). The exact check proves
    their sources; the logprob gate, their use."""
    is_deferred_attention_layer = internal("vllm.model_executor.layers.attention", "is_deferred_attention_layer")

    return [
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if is_deferred_attention_layer(module)
        for name, _ in module.named_parameters(recurse=False)
    ]


def _held_elsewhere(sent_name: str, experts: torch.nn.Module | None) -> bool:
    """Whether `sent_name`, written into a parameter of the fused expert
    layer `experts` (None: of no expert layer), is one expert's tensor
    (checkpoint form, `...experts.<id>....`) of an expert another engine
    holds: vLLM's loader skips those, so they add nothing here."""
    found = _ONE_EXPERT.search(sent_name)
    return experts is not None and found is not None and int(found.group(1)) not in local_expert_ids(experts)


# The exact check's fingerprint (exact_fingerprint says what it is and what it
# guarantees). Three sums of each element's mixed bits: `plain`, which does not
# depend on where an element sits; `by_column`, weighted by its column; and
# `by_position`, weighted by its column and its row. Integer arithmetic, exact
# in int64: the trainer's GPU, an engine's GPU and a CPU give the same sums.
FINGERPRINT_MODULUS = 1 << 62
_INDEX_LIMIT = 1 << 30  # every row and every column index below it has a weight of its own
_MASK30, _MASK31, _MASK32, _MASK62 = _INDEX_LIMIT - 1, (1 << 31) - 1, (1 << 32) - 1, FINGERPRINT_MODULUS - 1
_COLUMN_SEED, _ROW_SEED = 0x9E3779B9, 0x27D4EB2F


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values below 2**32 (products wrap; the low 32 bits are exact): a bijection of them."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _mix30(x: torch.Tensor) -> torch.Tensor:
    """A bijection of the int64 values below 2**30: each step is invertible
    (an xor with the value shifted right; a product by an odd number modulo 2**30)."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK30
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK30
    return x ^ (x >> 15)


def _weights(index: torch.Tensor, seed: int) -> torch.Tensor:
    """The weight of each row (or column) `index` (int64, below 2**30):
    2 * mix30((index + seed) mod 2**30) + 1, odd, below 2**31, and a
    different one for every index (index -> (index + seed) mod 2**30 and
    mix30 are bijections of the integers below 2**30)."""
    return _mix30((index.to(torch.int64) + seed) & _MASK30) * 2 + 1


def _times62(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a * w modulo 2**62 for int64 a below 2**62 and w below 2**31, exact:
    a split at bit 31, each partial product below 2**62, their sum below 2**63."""
    return (((((a >> 31) * w) & _MASK31) << 31) + (a & _MASK31) * w) & _MASK62


def _sum62(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sum of `a` (int64, each below 2**63, at most 2**31 of them along
    `dim`; None: all) modulo 2**62, exact: the bits above 31 and those below
    summed apart, each sum below 2**63."""
    high, low = (a >> 31).sum(dim), (a & _MASK31).sum(dim)
    return (((high & _MASK31) << 31) + (low & _MASK62)) & _MASK62


def exact_fingerprints(tensors) -> list[list[int]]:
    """exact_fingerprint of each tensor, waiting for the device once."""
    sums = exact_fingerprint_sums(tensors)
    return torch.stack(sums).cpu().tolist() if sums else []


class HeldFingerprints:
    """exact_fingerprints of tensors that stay where they are between syncs
    (an engine's parameters; a trainer's), from a CUDA graph that replays
    every kernel launch at once: a model of hundreds of tensors spends more
    time launching the few small kernels each one needs than the GPU spends
    in them. The graph reads the tensors where they were when it was
    captured: it is captured once the same tensors, at the same addresses,
    come twice in a row (a loader that allocates new ones is fingerprinted
    eagerly), and captured again once moved tensors come twice in a row.
    Each tensor may be cast first (`casts`: dtypes to cast it through, in
    order) and be a shard starting at a row of a larger tensor
    (`row_offsets`, _fingerprint_sums); a call with a tensor that needs a
    cast or a contiguous copy runs eagerly, since a graph would keep those
    copies' memory for as long as it lives. `start` runs them on a
    CUDA stream of their own, beside whatever the process does next, and
    returns what waits for them."""

    def __init__(self) -> None:
        self._last = None  # the previous call's tensors: (address, shape, stride, dtype, offset) each
        self._graph = self._sums = self._stream = None

    def __call__(self, tensors, row_offsets=None, casts=None) -> list[list[int]]:
        return self.start(tensors, row_offsets, casts)()

    def start(self, tensors, row_offsets=None, casts=None):
        """Launch the fingerprints; returns a function that waits for them and reads them back."""
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
        if key is None or key != self._last:  # new tensors (or ones a graph should not hold): eagerly
            self._last, self._graph, self._sums = key, None, None
        elif self._graph is None:  # the same tensors a second time: capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # Not torch.cuda.graph(): it empties PyTorch's cache first, and the
            # trainer would allocate its 4 GiB send buffer again next sync.
            # ("thread_local": vLLM's own threads may use CUDA meanwhile.)
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    captured = sums()
                finally:
                    graph.capture_end()
            self._graph, self._sums = graph, captured
        self._stream.wait_stream(torch.cuda.current_stream(tensors[0].device))  # what wrote them first
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
    """exact_fingerprint of each tensor as an int64 tensor of 3 on its device, not waited for."""
    return [_fingerprint_sums(t) for t in tensors]


def exact_fingerprint(tensor: torch.Tensor) -> list[int]:
    """[plain, by_column, by_position] of a tensor's elements, each modulo
    FINGERPRINT_MODULUS (2**62).

    The tensor is seen as [rows, columns]: its columns are its last dim (one
    for a 1-D tensor), its rows all the dims before, counted from the first
    row of the whole tensor that a shard or a piece is part of (`row_offset`
    of _fingerprint_sums). Each element's bits (those of an 8-byte element
    folded to 32) go through lowbias32, a bijection of 32-bit integers:
    m = mix32(bits ^ 0x5BD1E995), below 2**32, different for different bits.
    Then, modulo 2**62:

        plain       = sum of m
        by_column   = sum of m * cw(column)
        by_position = sum of m * cw(column) * rw(row)

    with cw and rw from _weights (a seed each; cw = 1 for a tensor of one
    column): w(i) = 2 * mix30((i + seed) mod 2**30) + 1, mix30 a bijection
    of the integers below 2**30, so every row index and every column index
    below 2**30 has an odd weight below 2**31 of its own (a tensor with more
    rows or columns is refused). Every intermediate stays below 2**63
    (m * cw; _times62; _sum62 for the sums), so the arithmetic is exact on
    any device, with no overflow.

    What it guarantees:

    - Sums add up. An element's three terms depend on its bits, its column
      and its row in the whole alone, so the sums of shards (rows of dim 0,
      each at its row_offset) and of pieces stacked on dim 0 (each at the
      rows it lands at) add up, modulo 2**62, to the whole's, all three;
      plain and by_column do not depend on the row, so the pieces' add up to
      the stack's wherever they land.

    - Two elements with different bits, exchanged, change a sum, always.
      Say u sits at (i, a) and v at (j, b), m(u) != m(v). For a != b,
      by_column changes by (cw(a) - cw(b)) * (m(v) - m(u)): cw(a) - cw(b)
      is twice the difference of two distinct mix30 values below 2**30, so
      nonzero with at most 1 + 29 factors of 2; m(v) - m(u) is nonzero and
      smaller than 2**32 in size, so at most 31. The product has at most 61:
      it is no multiple of 2**62. For a == b (so i != j), by_position changes
      by cw(a) * (rw(i) - rw(j)) * (m(v) - m(u)), cw(a) odd: the same. So do
      two rows (by_position) or two columns (by_column) exchanged that differ
      in one element.

    - Other rearrangements (two rows or columns exchanged that differ in
      several elements, blocks of rows exchanged, a transpose) change a sum
      by many such products added up, and those can cancel modulo 2**62.
      With fixed constants this is a checksum, not a cryptographic hash:
      data made against them can cancel. For data that is not, take the
      mixes of different bit patterns as independent uniform 32-bit values.
      The change is a sum over the bit patterns of A * m(pattern), A the
      pattern's weights where it is now less its weights where it was; if
      some A is not a multiple of 2**62, say with t factors of 2, then, the
      other mixes given, at most max(1, 2**(t - 30)) of the 2**32 values of
      that pattern's mix make the change vanish: a chance of at most
      2**-min(32, 62 - t). (A pattern one row holds once and the other not
      at all has t <= 30.)

    - It compares bits: +0.0 and -0.0, or two NaNs with other payloads,
      differ; two 8-byte elements whose bits fold to the same 32 do not."""
    return _fingerprint_sums(tensor).tolist()


@torch.no_grad()
def _fingerprint_sums(tensor: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
    """exact_fingerprint as an int64 tensor of 3 on the tensor's device: on a
    GPU, for 1-, 2- and 4-byte elements, in one pass of one kernel
    (_fingerprint_kernel); else with torch, in pieces of bounded size.
    `row_offset`: where the tensor's first row sits in a tensor it is a
    shard of (dim 0), so that the shards' sums add up to the whole's."""
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
        if rows.element_size() == 8:  # fold 64-bit patterns into 32
            bits = (bits ^ (bits >> 32)) & _MASK32
        plain = _mix32(bits ^ 0x5BD1E995)  # (the constant: so that zeros count too)
        by_column = plain * column_weight  # below 2**32 * 2**31
        first = first_row + start
        row_weight = _weights(torch.arange(first, first + bits.shape[0], device=rows.device), _ROW_SEED)
        row_sums = _sum62(by_column, 1)  # each row's by_column; its by_position is that times its row's weight
        sums[0] = (sums[0] + plain.sum()) & _MASK62
        sums[1] = (sums[1] + _sum62(row_sums)) & _MASK62
        sums[2] = (sums[2] + _sum62(_times62(row_sums, row_weight))) & _MASK62
    return sums


def _first_row(tensor: torch.Tensor, row_offset: int, rows: int | None = None) -> int:
    """The fingerprint's row (the tensor seen as [rows, columns]) of the first
    element of a shard that starts at `row_offset` on dim 0 of the whole.
    With the shard's `rows`: raises if a row or a column has no weight of its own."""
    first = row_offset * math.prod(tensor.shape[1:-1]) if tensor.dim() >= 2 else row_offset
    if rows is not None and not (0 <= first and first + rows <= _INDEX_LIMIT and _columns(tensor) <= _INDEX_LIMIT):
        raise ValueError(
            f"cannot fingerprint a tensor of shape {tuple(tensor.shape)} at row {first}: the fingerprint "
            f"tells apart rows and columns below {_INDEX_LIMIT}"
        )
    return first


def _columns(tensor: torch.Tensor) -> int:
    """The fingerprint's columns: the last dim's size (1 for a 1-D or empty-last-dim tensor)."""
    return tensor.shape[-1] if tensor.dim() >= 2 and tensor.shape[-1] > 0 else 1


def fingerprint_sums_triton(tensor: torch.Tensor, block: int = 8192, row_offset: int = 0) -> torch.Tensor:
    """_fingerprint_sums in one pass of a Triton kernel: each program mixes a
    tile of `block` elements (rows by columns of the tensor seen as [rows,
    columns]; `block` a power of 2) the way the torch code does, with the
    same arithmetic, and writes its three partial sums (each below 2**62);
    a second kernel adds those up. Reads the tensor once. A 2-D grid gives
    each element its row and column without a division. (On CPU only under
    TRITON_INTERPRET=1, as the tests run it against the torch code.)"""
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
# values (in uint32 where the torch code masks to 32 or 30 bits, which wrapping
# modulo 2**32 does the same to; in int64 where it does not).
if triton is not None:

    @triton.jit
    def _mix32_triton(x):  # _mix32 on uint32 (its products wrap, as `& _MASK32` does in _mix32)
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _mix30_triton(x):  # _mix30 on uint32 below 2**30 (a product modulo 2**32, then masked to 30 bits)
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0x3FFFFFFF
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & 0x3FFFFFFF
        return x ^ (x >> 15)

    @triton.jit
    def _weights_triton(index, seed):  # _weights, as uint32 (below 2**31)
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
        row_sums = _sum62_triton(by_column, 1)  # this tile's part of each row's by_column
        at = partial_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * 3
        tl.store(at + 0, tl.sum(tl.sum(tl.where(inside, plain.to(tl.int64), zero), axis=1), axis=0))
        tl.store(at + 1, _sum62_triton(row_sums, 0))
        tl.store(at + 2, _sum62_triton(_times62_triton(row_sums, row_weight), 0))

    @triton.jit
    def _sum_partials_kernel(partial_ptr, sums_ptr, tiles, BLOCK: tl.constexpr):
        """Program k: the sum of column k of `partial` ([tiles, 3], each below
        2**62) modulo 2**62, as the torch code adds up its chunks' sums."""
        k = tl.program_id(0)
        total = tl.zeros([BLOCK], dtype=tl.int64)  # each lane's share, below 2**62
        for start in range(0, tiles, BLOCK):
            tile = start + tl.arange(0, BLOCK)
            total = (total + tl.load(partial_ptr + tile * 3 + k, mask=tile < tiles, other=0)) & 0x3FFFFFFFFFFFFFFF
        tl.store(sums_ptr + k, _sum62_triton(total, 0))
