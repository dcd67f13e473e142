# SPDX-License-Identifier: Apache-2.0
"""Prove on each engine that every DP engine holds, bit for bit, what the trainer rank on its GPU sent.

This is the engine's half of the exact check, and its fingerprint. `ExactCheckWorker` is the direct
loader's worker extension from direct_load.py with the exact check's calls added. rlhf_ipc_fsdp_ep.py
starts the server with `--worker-extension-cls proof.exact_check_engine.ExactCheckWorker`. Its calls, made
through `/collective_rpc` on every engine, are:

    exact_check_prepare(sent)   once: which parameters each sent tensor is written into, at which rows
    exact_check_start()         after a sync: fingerprint what the engine holds, beside serving
    exact_check(expected)       compare with the trainer's fingerprints, and check what vLLM derives after
                                loading; raise naming what differs
    direct_load_fingerprint(a)  'store' / 'compare' every parameter, for benchmark.py's loaders_agree

exact_placement.py finds where each sent tensor lands; exact_derived.py checks what vLLM derives after loading.

The trainer's half, rank_measurement.FingerprintedSource, fingerprints what each rank sent with the same
function, `exact_fingerprint`. It uses integer arithmetic that gives the same result on a GPU and a CPU,
so the two sides' sums match exactly.
"""

from __future__ import annotations

import json
import time

import torch

from proof import exact_accounting
from proof.exact_derived import derived_parameters, derived_problems, derived_views, owns_any
from proof.exact_placement import (
    FP8_BLOCKS,
    exact_targets,
    fp8_layers,
    fp8_layers_by_vllms_loader,
    piece_rows,
    probed_parameters,
)
from proof.fingerprint import (
    FINGERPRINT_MODULUS,
    HeldFingerprints,
    exact_fingerprint,
    exact_fingerprint_sums,
    exact_fingerprints,
    fingerprint_sums,
)
from weight_sync import fp8_experts
from weight_sync.direct_load import DirectLoadWorker, _gpu_uuid, _no_trainer_rank
from weight_sync.fp8_experts import fp8_reference


class ExactCheckWorker(DirectLoadWorker):
    """Add the exact check's calls to DirectLoadWorker; every method runs on every engine."""

    def direct_load_start(self, in_place: str | dict = "") -> dict:
        self._exact_started = None  # What exact_check_start saw of the weights held before this sync is stale now.
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
                write_profile(profiler, self._profile_path)
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

    def exact_check_prepare(self, sent: str, trainer_view: str = "") -> dict:
        """Learn which of this engine's parameters each tensor the trainer sends is written into.

        `sent` is JSON [[name, dtype, shape, is_expert_block], ...], the source's metadata in send order; see
        exact_targets. Also learn where each piece of a parameter written from several tensors lands in it,
        returned as "rows" from piece_rows, for the trainer to fingerprint each piece at. `trainer_view` is JSON
        {"trainer_gpu_uuids": [...], "holders": {index: trainer rank}}, the trainer's own layout of the
        experts, which exact_accounting.unaccounted checks every sent tensor against; without it this engine
        must hold every one. Call it before a full sync, because it leaves every parameter it probes zeroed
        until the sync overwrites it.
        """
        model, sent = self.model_runner.get_model(), json.loads(sent)
        self._exact_targets, casts, self._exact_values_only, whole = exact_targets(model, sent, self.vllm_config)
        rows, placed, by_value = piece_rows(model, sent, self._exact_targets, whole, self._exact_values_only)
        self._exact_whole = sorted(set(whole) | set(placed))  # Every element is compared in its place.
        view = json.loads(trainer_view) if trainer_view else {}
        ranks, uuid = view.get("trainer_gpu_uuids", []), _gpu_uuid(next(model.parameters()).device)
        not_probed = tuple(f"{layer.layer_name}." for _, layer in fp8_layers_by_vllms_loader(model, sent))
        self._exact_unaccounted, self._exact_casts = exact_accounting.unaccounted(
            model,
            sent,
            self._exact_targets,
            casts,
            ranks.index(uuid) if uuid in ranks else None,
            {int(i): rank for i, rank in view.get("holders", {}).items()},
            not_probed,
        )
        with torch.no_grad():  # Zero the probes' constants, up to 3e38, which would overflow what it serves.
            params = dict(model.named_parameters())
            for name in probed_parameters(sent, self._exact_targets):
                params[name].zero_()
        self._exact_unchecked = quantized_by_vllms_loader(model, sent)
        self._exact_comparisons = exact_accounting.comparisons(
            model,
            self._exact_targets,
            self._exact_whole,
            self._exact_values_only,
            set(self._exact_unchecked),
            set(derived_parameters(model)),
        )
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
            "unaccounted": self._exact_unaccounted,
            "not_compared": {k: v for k, v in self._exact_comparisons.items() if k not in ("bit_for_bit", "derived")},
            "derived": self._exact_comparisons["derived"],
        }

    def exact_check_start(self) -> dict:
        """Start fingerprinting what this engine holds after a sync, on its own CUDA stream.

        It runs beside whatever the engine serves next. Also check, now, what vLLM derives after loading
        (_derived_problems). exact_check judges both, or does both then if this was not called.
        """
        targets = self._exact_targets_or_raise()
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        names = checked_parameters(model, targets)
        fingerprints = self._held_fingerprints.start(params[n] for n in names)
        self._exact_started = (fingerprints, *self._derived_problems(model))
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
            return started[0]() if started is not None else self._held_fingerprints(tensors)

        checked, problems = exact_problems(
            model,
            targets,
            sent,
            self._exact_values_only,
            self._exact_whole,
            fingerprints,
            unchecked=getattr(self, "_exact_unchecked", ()),
        )
        unaccounted = getattr(self, "_exact_unaccounted", [])
        derived = self._exact_comparisons["derived"]
        stale, views = started[1:] if started is not None else self._derived_problems(model)
        if problems or unaccounted or stale:
            fp8_parameters = fp8_parameter_names(model)
            if any(problem.split(": ", 1)[0] in fp8_parameters for problem in problems):
                # Quantize through vLLM's own function from the next sync on.
                fp8_experts._KERNEL_AGREES[next(model.parameters()).device] = False
            found = [f"{len(unaccounted)} sent tensors not held as sent: " + "; ".join(unaccounted[:4])]
            found = (
                (found if unaccounted else [])
                + ([f"{len(problems)} of {checked} parameters differ: " + "; ".join(problems[:4])] if problems else [])
                + (
                    [
                        f"{len(stale)} of {len(derived)} parameters vLLM derives after loading differ (its post-load "
                        "processing did not run after the sync, or ran before it): " + "; ".join(stale[:4])
                    ]
                    if stale
                    else []
                )
            )
            raise RuntimeError(f"exact check: DP engine {dp_rank}: " + "; ".join(found))
        compared = self._exact_comparisons
        return {
            "dp_rank": dp_rank,
            "parameters": checked,
            "seconds": time.perf_counter() - start,
            "held": sum(map(len, compared.values())),
            "bit_for_bit": len(compared["bit_for_bit"]),
            "derived": derived,
            "derived_views": views,
            "not_compared": {k: v for k, v in compared.items() if k not in ("bit_for_bit", "derived") and v},
            "casts": self._exact_casts,
        }

    def _derived_problems(self, model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
        """Return derived_problems for the parameters prepared as derived, less derived_views, and those views.

        The layers that own derived parameters are found once."""
        names = set(self._exact_comparisons["derived"])
        views = derived_views(model, names, set(self._exact_comparisons["bit_for_bit"]))
        layers = getattr(self, "_exact_derived_layers", None)
        if layers is None or layers[0] is not model:
            owners = [(prefix, layer) for prefix, layer in model.named_modules() if owns_any(layer, prefix, names)]
            self._exact_derived_layers = layers = (model, owners)
        return derived_problems(layers[1], self.vllm_config, names - set(views)), views

    def _exact_targets_or_raise(self) -> list[list[str]]:
        targets = getattr(self, "_exact_targets", None)
        if targets is None:
            raise RuntimeError("exact_check_prepare was not called")
        return targets


def write_profile(profiler, path: str) -> None:
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


def held_fingerprint_sums(tensor: torch.Tensor, held: str | None, row_offset: int = 0) -> torch.Tensor:
    """Return the fingerprint sums of what vLLM holds of a sent tensor, given exact_targets' cast `held`.

    For a plain cast, that is the tensor in that dtype, as an int64 tensor of 3. For an expert block that
    vLLM holds in FP8, it is vLLM's own quantization of it from fp8_experts.fp8_reference, as
    [[weight's], [scales']]. `row_offset` is the row of the parameter it lands at, from piece_rows.
    """
    if held and held.startswith(FP8_BLOCKS):
        quantized = fp8_reference(tensor.to(torch.bfloat16), int(held.removeprefix(FP8_BLOCKS)))
        return torch.stack(exact_fingerprint_sums(quantized))
    return fingerprint_sums(held_as(tensor, held), row_offset)


def quantized_by_vllms_loader(model: torch.nn.Module, sent: list) -> list[str]:
    """Return the names of FP8 expert layers' weights and scales that vLLM's own loader writes from what is sent.

    These exclude the direct loader's blocks. vLLM's loader quantizes each expert from its pieces, so these
    are not compared with the trainer's. benchmark.py's loaders_agree instead compares them with the direct
    loader's, which the exact check proves.
    """
    return _parameter_names(fp8_layers_by_vllms_loader(model, sent))


def fp8_parameter_names(model: torch.nn.Module) -> set[str]:
    """Return the names of the weights and scales of every expert layer vLLM serves in FP8."""
    return set(_parameter_names(fp8_layers(model)))


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
