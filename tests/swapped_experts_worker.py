# SPDX-License-Identifier: Apache-2.0
"""A server-side fault for a GPU run through vLLM's loader (`scripts/with_worker.py
swapped_experts_worker.SwappedExpertsWorker ... --weight-loader vllm`): from the
first sync on, every layer's expert 0 and expert 1 trade names on the way into
vLLM's `load_weights`, as a conversion or naming bug on the trainer's side would
send them. The exact check learned where each name lands before (exact_check_prepare
probes through the loader as it is), so it must name every layer's w13 and w2."""

import re

from proof.exact_check_engine import ExactCheckWorker

_EXPERT_0_OR_1 = re.compile(r"\.experts\.([01])\.")


def swapped_name(name: str) -> str:
    return _EXPERT_0_OR_1.sub(lambda m: f".experts.{1 - int(m[1])}.", name)


class SwappedExpertsWorker(ExactCheckWorker):
    def exact_check_prepare(self, sent: str, trainer_view: str = "") -> dict:
        answer = super().exact_check_prepare(sent, trainer_view)
        model = self.model_runner.get_model()
        if not getattr(model, "_experts_swapped", False):  # from now on: the syncs
            load = model.load_weights

            def load_swapped(weights, *args, **kwargs):
                return load(((swapped_name(n), t) for n, t in weights), *args, **kwargs)

            model.load_weights, model._experts_swapped = load_swapped, True
            print("[swapped_experts_worker] every layer's experts 0 and 1 trade names from now on", flush=True)
        return answer
