"""Draw docs/img/*.png from the benchmarks' raw results (bench/results/*.json).

Each benchmark writes its rows with `--json bench/results/<name>.json` (the `make bench-*`
targets do); this script only reads them, so a figure can be redrawn without re-running anything:

- plan_quality.json  -> docs/img/plan-quality.png  (simulated iteration of each baseline / cpsat's,
                                                     pinned pipelines, per model and cluster)
- plan_measured.json -> docs/img/plan-measured.png (measured vs predicted iteration per plan)
- compile_scale.json -> docs/img/compile-scale.png (wall time, per-step time and peak RSS vs
                                                     parameters)
- launch.json        -> docs/img/runtime.png        (samples/s: single process, partc, hand-written)

A missing results file skips its figure. Matplotlib's Agg backend, no timestamps in the files.

    .venv/bin/python bench/plots.py [--results bench/results] [--out docs/img]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STRATEGY_COLOURS = {"cpsat": "#1f77b4", "chain-dp": "#2ca02c", "uniform": "#ff7f0e",
                    "params": "#d62728"}
_META = {"Software": None, "Creation Time": None}  # no matplotlib version/date: stable bytes


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata=_META)
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def plan_quality(data: dict[str, Any], out: Path) -> None:
    """Per pinned case, each strategy's simulated iteration over cpsat's (1 = as fast)."""
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in data["rows"]:
        if r["setting"] != "free":
            groups.setdefault((r["model"], r["cluster"], r["setting"]), {})[r["strategy"]] = r
    cases = [(k, g) for k, g in groups.items() if g.get("cpsat", {}).get("shape")]
    if not cases:
        return
    others = ("uniform", "params", "chain-dp")
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(cases) + 1.5))
    height = 0.8 / len(others)
    labels = []
    for i, ((model, cluster, setting), g) in enumerate(cases):
        labels.append(f"{model} · {cluster} · {setting}")
        base = g["cpsat"]["iteration_s"]
        for j, s in enumerate(others):
            y = i + (j - 1) * height
            r = g.get(s)
            if r is None or r.get("shape") is None:
                ax.plot([1.0], [y], marker="x", color=STRATEGY_COLOURS[s], markersize=5)
                continue
            ax.barh(y, r["iteration_s"] / base - 1.0, left=1.0, height=height,
                    color=STRATEGY_COLOURS[s], label=s if i == 0 else None)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(cases)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("simulated iteration time / cpsat's (right of 1: slower than cpsat; "
                  "x: no plan that fits)")
    ax.set_title("Plan quality on pinned pipelines (analytic costs)")
    ax.legend(loc="lower right", fontsize=8)
    _save(fig, out / "plan-quality.png")


def plan_measured(data: dict[str, Any], out: Path) -> None:
    """Measured vs predicted iteration time of every launched plan (log-log, y = x dashed)."""
    rows = [r for r in data["rows"] if r.get("measured_step_s") and r.get("predicted_iteration_s")
            and not r.get("same_plan_as")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = {2: "o", 4: "s"}
    for r in rows:
        ax.scatter(r["predicted_iteration_s"] * 1e3, r["measured_step_s"] * 1e3,
                   color=STRATEGY_COLOURS[r["strategy"]], marker=markers.get(r["processes"], "^"),
                   s=28)
    xs = [r["predicted_iteration_s"] * 1e3 for r in rows]
    ys = [r["measured_step_s"] * 1e3 for r in rows]
    lo, hi = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="measured = predicted")
    for r in rows:
        if r["strategy"] == "cpsat":
            ax.annotate(r["model"], (r["predicted_iteration_s"] * 1e3, r["measured_step_s"] * 1e3),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    for s, c in STRATEGY_COLOURS.items():
        ax.scatter([], [], color=c, label=s)
    for n, m in markers.items():
        ax.scatter([], [], color="grey", marker=m, label=f"{n} processes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted iteration (ms, plan.yaml)")
    ax.set_ylabel("measured step (ms, partc launch, median)")
    ax.set_title("Predicted vs measured on this CPU (gloo, 1 thread per process)")
    ax.legend(fontsize=7)
    _save(fig, out / "plan-measured.png")


def compile_scale(data: dict[str, Any], out: Path) -> None:
    """Wall time and peak RSS vs parameters per family and cluster; per-step time on one cluster."""
    rows = data["rows"]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"gpt": "-", "bert": "--"}
    clusters = sorted({r["cluster"] for r in rows})
    # strict=False: a palette of three, taken as far as there are clusters
    colours = dict(zip(clusters, ("#1f77b4", "#ff7f0e", "#2ca02c"), strict=False))
    for family in sorted({r["family"] for r in rows}):
        for cluster in clusters:
            pts = sorted((r["params"] / 1e9, r) for r in rows
                         if r["family"] == family and r["cluster"] == cluster)
            if not pts:
                continue
            xs = [p for p, _ in pts]
            label = f"{family} on {cluster}"
            axes[0].plot(xs, [r["wall_s"] for _, r in pts], styles[family], marker="o",
                         color=colours[cluster], label=label)
            axes[2].plot(xs, [r["rss_mib"] / 1024 for _, r in pts], styles[family], marker="o",
                         color=colours[cluster], label=label)
            for x, r in pts:
                if not r["fits"]:
                    axes[0].annotate("no fit", (x, r["wall_s"]), fontsize=7, xytext=(3, -9),
                                     textcoords="offset points")
    axes[0].axhline(300, color="grey", linestyle=":", linewidth=0.8)
    axes[0].text(0.1, 300, " 5 min (4.9B goal)", fontsize=7, va="bottom")
    axes[0].axhline(900, color="grey", linestyle=":", linewidth=0.8)
    axes[0].text(0.1, 900, " 15 min (100B goal)", fontsize=7, va="bottom")
    axes[0].set_title("partc compile wall time (fresh process)")
    axes[0].set_ylabel("seconds")
    axes[2].axhline(4, color="grey", linestyle=":", linewidth=0.8)
    axes[2].text(0.1, 4, " 4 GB (4.9B goal)", fontsize=7, va="bottom")
    axes[2].set_title("peak RSS")
    axes[2].set_ylabel("GiB")
    # Per-step time on the larger cluster, both families.
    big = clusters[-1]
    steps = ("load", "export", "opgraph", "cost", "coarsen", "solve", "emit")
    step_colours = plt.get_cmap("tab10")
    onnx = {(o["family"], o["size"]): o.get("onnx_s") for o in data.get("onnx", [])}
    for family in sorted({r["family"] for r in rows}):
        pts = sorted((r["params"] / 1e9, r) for r in rows
                     if r["family"] == family and r["cluster"] == big)
        xs = [p for p, _ in pts]
        for k, step in enumerate(steps):
            ys = [r["steps"].get(step) for _, r in pts]
            if any(y is None for y in ys):
                continue
            axes[1].plot(xs, [max(y, 0.05) for y in ys], styles[family], marker=".",
                         color=step_colours(k), label=step if family == "gpt" else None)
        ox = [(p, onnx.get((family, r["size"]))) for p, r in pts]
        ox = [(p, y) for p, y in ox if y is not None]
        if ox:
            axes[1].plot([p for p, _ in ox], [y for _, y in ox], styles[family], marker=".",
                         color=step_colours(len(steps)),
                         label="onnx (inspect)" if family == "gpt" else None)
    axes[1].set_title(f"per step on {big} (solid: gpt, dashed: bert)")
    axes[1].set_ylabel("seconds")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("parameters (billions)")
        ax.grid(True, which="major", linewidth=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7, ncol=2)
    _save(fig, out / "compile-scale.png")


def runtime(data: dict[str, Any], out: Path) -> None:
    """Samples/s of each run of bench/launch.py (median over repeats)."""
    labels = {"single": "single process", "partc_2": "partc, 2 stages",
              "hand_2": "hand-written, 2 stages", "partc_2x2": "partc, 2x2",
              "hand_2x2": "hand-written, 2x2"}
    batch = data["config"]["batch"]
    keys = [k for k in labels if f"{k}_s" in data["median"]]
    values = [batch / data["median"][f"{k}_s"] for k in keys]
    colours = ["grey" if k == "single" else "#1f77b4" if k.startswith("partc") else "#ff7f0e"
               for k in keys]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    bars = ax.barh(range(len(keys)), values, color=colours)
    for bar, v in zip(bars, values, strict=True):  # one bar per value
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:,.0f}",
                va="center", fontsize=8)
    ax.set_yticks(range(len(keys)), [labels[k] for k in keys])
    ax.invert_yaxis()
    ax.set_xlabel(f"samples/s (mlp_stack, batch {batch}, median of "
                  f"{data['config']['repeats']} repeats)")
    ax.set_title("Runtime on this 2-core CPU (gloo, 1 thread per process)")
    _save(fig, out / "runtime.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    for name, draw in (("plan_quality", plan_quality), ("plan_measured", plan_measured),
                       ("compile_scale", compile_scale), ("launch", runtime)):
        path = args.results / f"{name}.json"
        if path.exists():
            draw(json.loads(path.read_text()), args.out)
        else:
            print(f"skipped {name}: no {path}")


if __name__ == "__main__":
    main()
