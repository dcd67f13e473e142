# SPDX-License-Identifier: Apache-2.0
"""scripts/plot_phases.py: the phase chart from the script's and benchmark.py's JSON."""

import importlib.util
import json
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_phases", ROOT / "scripts" / "plot_phases.py")
plot_phases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_phases)


def a_round(send: float, breakdown: bool = True) -> dict:
    record = {"phases_s": {"sleep": 0.1, "wake_weights": 0.2, "send": send, "wake_kv": 0.03}}
    record["cycle_s"] = sum(record["phases_s"].values())
    if breakdown:
        rank0 = {"source": 0.4, "server_update_weights": send - 0.5, "server_update_weights_calls": 35, "total": send}
        record["send_breakdown_s"] = [rank0, {"source": 0.4, "total": send}]
    return record


def test_the_chart_has_a_bar_per_run_and_loader_and_names_every_phase(tmp_path):
    script_json = tmp_path / "run.json"
    script_json.write_text(
        json.dumps(
            {"weight_loader": "direct", "command": "python3 x.py", "rounds": [a_round(1.2), a_round(1.3), a_round(1.1)]}
        )
    )
    bench_json = tmp_path / "bench.json"
    bench_json.write_text(
        json.dumps(
            {
                "command": "python3 benchmark.py --enforce-eager",
                "variants": [
                    {"weight_loader": "vllm", "rounds": [a_round(27.0)]},
                    {"weight_loader": "direct", "sleep_level": 0, "rounds": [a_round(1.2, breakdown=False)]},
                ],
            }
        )
    )
    out = tmp_path / "phases.svg"

    assert plot_phases.main([str(out), str(script_json), str(bench_json), "--xmax", "2.5"]) == 0

    text = out.read_text()
    ET.fromstring(text)  # well-formed SVG
    for phase in (
        "sleep",
        "wake weights",
        "send: source",
        "send: server",
        "send: other",
        "send (not split)",
        "wake KV cache",
    ):
        assert f">{phase}" in text
    assert "direct loader, 1 GiB buffer, compiled server" in text
    assert "vLLM&#x27;s loader, 1 GiB buffer, eager server" in text
    assert "direct loader, 1 GiB buffer, eager server, sleep level 0" in text  # a variant's own sleep level
    assert "27.33 s, cut" in text  # longer than --xmax: cut, with its full length
    # the script's run: the medians, and the send split as rank 0 saw it
    run = plot_phases.runs_in(script_json)[0]
    assert run["segments"]["send_source"] == 0.4
    assert abs(run["segments"]["send_server"] - 0.7) < 1e-9
    assert abs(run["segments"]["send_other"] - 0.1) < 1e-9
