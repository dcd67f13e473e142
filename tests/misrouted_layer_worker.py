# SPDX-License-Identifier: Apache-2.0
"""A server-side fault for a GPU run through vLLM's loader (`scripts/with_worker.py
misrouted_layer_worker.MisroutedLayerWorker ... --weight-loader vllm`): from the
exact check's prepare on, layer 0's and layer 1's input_layernorm trade places on
the way into vLLM's `load_weights`, as a loader that maps a name to the wrong
parameter of the same shape would. Each parameter is then written whole by a
tensor of its shape, so comparing the parameters alone would pass; the exact
check must name both tensors as written into another layer's parameter."""

import re

from proof.exact_check_engine import ExactCheckWorker

_NORM_OF_LAYER_0_OR_1 = re.compile(r"^(model\.layers\.)([01])(\.input_layernorm\.weight)$")


def misrouted_name(name: str) -> str:
    return _NORM_OF_LAYER_0_OR_1.sub(lambda m: f"{m[1]}{1 - int(m[2])}{m[3]}", name)


class MisroutedLayerWorker(ExactCheckWorker):
    def exact_check_prepare(self, sent: str, trainer_view: str = "") -> dict:
        model = self.model_runner.get_model()
        if not getattr(model, "_layers_misrouted", False):  # from now on: the prepare's probes and the syncs
            load = model.load_weights

            def load_misrouted(weights, *args, **kwargs):
                return load(((misrouted_name(n), t) for n, t in weights), *args, **kwargs)

            model.load_weights, model._layers_misrouted = load_misrouted, True
            print("[misrouted_layer_worker] layers 0 and 1 trade input_layernorm from now on", flush=True)
        return super().exact_check_prepare(sent, trainer_view)
