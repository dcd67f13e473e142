"""A test's window into a CPU server's engine: ExactCheckWorker with two more
calls: `parameter_names(prefix)` and `read_parameter(name)` (its values, float32)."""

from exact_check_engine import ExactCheckWorker


class ParameterReader(ExactCheckWorker):
    def parameter_names(self, prefix: str) -> list[str]:
        return [n for n, _ in self.model_runner.get_model().named_parameters() if n.startswith(prefix)]

    def read_parameter(self, name: str) -> list:
        return dict(self.model_runner.get_model().named_parameters())[name].float().tolist()
