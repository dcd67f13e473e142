# SPDX-License-Identifier: Apache-2.0
"""A test's window into a CPU server's engine: ExactCheckWorker with more
calls: `parameter_names(prefix)`, `read_parameter(name)` (its values,
float32), `fp8_parameter_names()` (exact_check_engine's), and
`fp8_kernel_agrees()` (fp8_experts' verdict per device)."""

from proof import exact_check_engine
from proof.exact_check_engine import ExactCheckWorker
from weight_sync import fp8_experts


class ParameterReader(ExactCheckWorker):
    def parameter_names(self, prefix: str) -> list[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters() if n.startswith(prefix)]

    def read_parameter(self, name: str) -> list:
        return dict(self.model_runner.get_model().named_parameters())[name].float().tolist()

    def fp8_parameter_names(self) -> list[str]:
        return sorted(exact_check_engine.fp8_parameter_names(self.model_runner.get_model()))

    def fp8_kernel_agrees(self) -> dict:
        return {str(device): agrees for device, agrees in fp8_experts._KERNEL_AGREES.items()}
