# SPDX-License-Identifier: Apache-2.0
"""Chart where a weight sync's time goes: one stacked horizontal bar per run and loader.

    python scripts/plot_phases.py OUT.svg RESULT.json [RESULT.json ...] [--xmax SECONDS]

Each RESULT.json is what rlhf_ipc_fsdp_ep.py --json writes (its "rounds") or
what benchmark.py writes (its "variants", each with a "weight_loader" and its
"rounds"). Each bar is one run and loader; its segments are the sync's phases
in order: sleep, wake_weights, send, wake_kv. Where a round has rank 0's
`send_breakdown_s`, send is split into `source` (producing the tensors:
host time in runs from 2026-11-30 on, before that with the GPU's
gathers and casts), `server` (rank 0 waiting on the server: start, every chunk, finish)
and `other` (the rest of the send: packing and the trainer ranks'
handshakes). Every segment is the median over the run's rounds of that
segment; the number at the bar's end is the median cycle. A bar longer than
--xmax is cut, marked, and labelled with its full length.

The chart is a self-contained SVG, written by hand: no plotting library needed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from html import escape
from pathlib import Path

# (key, legend, colour), in the order the segments are stacked.
SEGMENTS = [
    ("sleep", "sleep", "#8c8c8c"),
    ("wake_weights", "wake weights", "#b3b3b3"),
    ("send", "send (not split)", "#4c72b0"),
    ("send_source", "send: source (producing tensors)", "#55a868"),
    ("send_server", "send: server (rank 0 waits)", "#c44e52"),
    ("send_other", "send: other (packing, handshakes)", "#dd8452"),
    ("wake_kv", "wake KV cache", "#8172b3"),
]
LOADER_NAMES = {"vllm": "vLLM's", "direct": "direct"}


def round_segments(record: dict, split: bool = True) -> dict[str, float]:
    """One round's seconds per segment (send split, if `split` and the round allows)."""
    phases = record["phases_s"]
    out = {"sleep": phases["sleep"], "wake_weights": phases["wake_weights"], "wake_kv": phases["wake_kv"]}
    rank0 = (record.get("send_breakdown_s") or [{}])[0]
    server = sum(v for k, v in rank0.items() if k.startswith("server_") and not k.endswith("_calls"))
    if split and "source" in rank0 and server:
        out["send_source"] = rank0["source"]
        out["send_server"] = server
        out["send_other"] = max(phases["send"] - rank0["source"] - server, 0.0)
    else:
        out["send"] = phases["send"]
    return out


def run_label(facts: dict, loader: str, sleep_level: int | None = None) -> str:
    mode = "eager" if "--enforce-eager" in facts.get("command", "") else "compiled"
    level = f", sleep level {sleep_level}" if sleep_level is not None else ""
    if facts.get("packed", True):
        size = facts.get("packed_buffer_size_bytes", 1 << 30) / (1 << 30)
        buffer = f"{size:g} GiB buffer"
    else:
        buffer = "unpacked"
    return f"{LOADER_NAMES.get(loader, loader)} loader, {buffer}, {mode} server{level}"


def runs_in(path: Path) -> list[dict]:
    """Every run and loader in one result file: label, file, medians."""
    facts = json.loads(path.read_text())
    variants = facts.get("variants") or [facts]
    runs = []
    for variant in variants:
        rounds = [round_segments(r) for r in variant["rounds"]]
        if not rounds:
            continue
        if not all("send_source" in r for r in rounds):  # split every round's send, or none
            rounds = [round_segments(r, split=False) for r in variant["rounds"]]
        keys = [key for key, _, _ in SEGMENTS if key in rounds[0]]
        runs.append(
            {
                "label": run_label(
                    {**facts, **variant},
                    variant.get("weight_loader", "vllm"),
                    variant.get("sleep_level", facts.get("sleep_level")),
                ),
                "file": f"{path.parent.name}/{path.name}",
                "rounds": len(rounds),
                "segments": {key: statistics.median(r[key] for r in rounds) for key in keys},
                "cycle": statistics.median(r["cycle_s"] for r in variant["rounds"]),
            }
        )
    return runs


def nice_step(span: float, most: int = 8) -> float:
    """A round tick step that puts at most `most` ticks over `span`."""
    for step in (0.05, 0.1, 0.2, 0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100):
        if span / step <= most:
            return step
    return 10 ** math.ceil(math.log10(span / most))


def svg(runs: list[dict], xmax: float | None = None, title: str = "") -> str:
    label_w, bar_w, right, row_h, bar_h = 440, 520, 100, 46, 24
    used = [s for s in SEGMENTS if any(s[0] in r["segments"] for r in runs)]
    legend_rows = math.ceil(len(used) / 3)
    top = 40 + 20 * legend_rows + 10
    width = label_w + bar_w + right
    height = top + row_h * len(runs) + 60
    longest = max(sum(r["segments"].values()) for r in runs)
    limit = xmax if xmax else longest * 1.02
    scale = bar_w / limit

    out = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">'
        ),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for i, (_, name, colour) in enumerate(used):
        x, y = 10 + (i % 3) * 300, 40 + 20 * (i // 3)
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 18}" y="{y}">{escape(name)}</text>')

    axis_y = top + row_h * len(runs)
    step = nice_step(limit)
    for k in range(int(limit / step + 1e-9) + 1):
        x = label_w + k * step * scale
        out.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{axis_y}" stroke="#e0e0e0"/>')
        out.append(f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{k * step:g}</text>')
    out.append(
        f'<text x="{label_w + bar_w / 2}" y="{axis_y + 36}" text-anchor="middle">seconds '
        "(each segment: median over rounds; at the bar's end: median cycle)</text>"
    )

    for row, run in enumerate(runs):
        y = top + row * row_h + (row_h - bar_h) / 2
        out.append(f'<text x="{label_w - 8}" y="{y + 10}" text-anchor="end">{escape(run["label"])}</text>')
        out.append(
            f'<text x="{label_w - 8}" y="{y + 24}" text-anchor="end" font-size="10" fill="#666">'
            f"{escape(run['file'])}, {run['rounds']} rounds</text>"
        )
        start = 0.0
        for key, name, colour in SEGMENTS:
            if key not in run["segments"]:
                continue
            seconds = run["segments"][key]
            x0, x1 = start * scale, min(start + seconds, limit) * scale
            start += seconds
            if x1 <= x0:
                continue
            out.append(
                f'<rect x="{label_w + x0:.1f}" y="{y}" width="{x1 - x0:.1f}" height="{bar_h}" '
                f'fill="{colour}"><title>{escape(name)}: {seconds:.3f} s</title></rect>'
            )
            if x1 - x0 >= 28:
                out.append(
                    f'<text x="{label_w + (x0 + x1) / 2:.1f}" y="{y + 16}" text-anchor="middle" '
                    f'fill="white" font-size="11">{seconds:.2f}</text>'
                )
        end = min(start, limit) * scale + label_w
        if start > limit:  # cut: a white break across the bar's end
            out.append(
                f'<path d="M{end - 14:.1f},{y + bar_h + 3} l8,{-bar_h - 6} m4,0 l-8,{bar_h + 6}" '
                'stroke="white" stroke-width="3" fill="none"/>'
            )
            text = f"{run['cycle']:.2f} s, cut"
        else:
            text = f"{run['cycle']:.2f} s"
        out.append(f'<text x="{end + 6:.1f}" y="{y + 16}" font-weight="bold">{text}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the SVG to write")
    p.add_argument("results", nargs="+", help="result JSON files (the script's or benchmark.py's)")
    p.add_argument("--xmax", type=float, help="seconds at the right edge; longer bars are cut")
    p.add_argument("--title", default="Weight sync, phase by phase")
    args = p.parse_args(argv)
    runs = [run for path in args.results for run in runs_in(Path(path))]
    if not runs:
        p.error("no rounds in the given files")
    Path(args.out).write_text(svg(runs, args.xmax, args.title))
    for run in runs:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in run["segments"].items())
        print(f"{run['label']} ({run['file']}): {parts}; cycle {run['cycle']:.3f} s")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
