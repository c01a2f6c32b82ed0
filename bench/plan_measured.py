"""Measured plan quality on this machine: does a plan's predicted iteration time hold when
`partc launch` trains it, and do cpsat's plans train faster than the baselines' plans?

For each example model (examples/{mlp,transformer,bert,gpt2,resnet}.py) and each process count,
every stage-cutting strategy (cpsat, chain-dp, uniform = Megatron-style equal layers, params =
DeepSpeed-style balanced parameters) compiles a plan, and each distinct plan is trained:

    partc compile examples/X.py -b B --cluster cpu   --stages 2              --strategy S -o DIR
    partc compile examples/X.py -b B --cluster cpu-4 --stages 4 --replicas 1 --strategy S -o DIR
    OMP_NUM_THREADS=1 partc launch DIR/plan.yaml --steps N --metrics DIR/metrics.jsonl

- 2 processes: the `cpu` cluster (2 calibrated gloo devices, one per core); 4 processes: `cpu-4`
  (4 devices oversubscribed on the 2 cores). Stages are pinned so every strategy cuts the same
  number of pipeline stages; micro-batches, schedule and checkpointing are left to each strategy's
  search, because choosing them for its own cut is part of what a strategy's plan is (each
  baseline's stages are priced and its shape searched by the same simulator, docs/solver.md).
- Prediction: plan.yaml's `predicted.iteration_s` and `predicted.samples_per_s`.
- Measurement: `step_s` of the launch's metrics file (rank 0's wall time of one step: data,
  pipeline schedule, tied-gradient sum, optimizer step), median over the steps after two warm-up
  steps; samples/s = B / that median.
- Identical plans: strategies whose plans have the same stage files (the sha256 in plan.yaml) and
  the same training shape (stages, replicas, micro-batches and their size, schedule, virtual
  stages, checkpointing, placement) are one plan; it is launched once and the others are reported
  as "same plan as <strategy>" with its numbers (on a 2-core machine launches are the cost).
- Repeats (`--repeats R`): each plan is compiled once (compiles are deterministic). By default
  (`--order case`) each (model, processes) case's R repeats are launched right after its
  compile, each repeat launching every distinct plan of the case in turn, starting at a different
  plan each repeat, so drift and the position in the sequence hit all strategies alike. A plan's
  prediction is priced with the profile its compile measured, and this VM's speed drifts by up to
  1.5x within 20 minutes and by model (run U, 2026-11-28: BERT's stage work 1.3-1.5x its profile,
  the transformer's 0.8x, launched 10-25 minutes after everything was compiled), so a prediction
  is checked against launches minutes, not the whole run, after its profile was measured.
  `--order round` compiles everything first and then runs one round of every case per repeat
  (the order before 2026-11-28). Tables show medians over repeats; cpsat-vs-baseline throughput
  ratios are computed per repeat (cpsat samples/s / baseline samples/s), then medianed.
- Global batches (BATCH below): big enough that a step's compute is not lost in the fixed per-step
  cost of a launch (gloo round trips, Python dispatch, ~20 ms here) yet a launch of N steps stays
  a few seconds of training: the MLP is tiny (a 64-sample step is ~1 ms of predicted compute,
  ~25 ms measured, all overhead), so it gets 4096 (as bench/launch.py); the transformer and ResNet
  get 64 and the two Hugging Face models 32 (~0.1-0.2 s predicted per step, ~0.3-0.9 s measured).

Caveats: with 4 processes on 2 cores two processes share each core (launch pins process i to core
i % 2); `cpu-4` says so (`cores_per_node: 2`) and the simulator time-shares each core between the
processes busy on it. The machine may be shared: the load average at the start is printed with
the machine; from one run to the next the same plan's step time drifted by 5-15% here, so compare
strategies within a run and use repeats. An order of strategies is only measured where their
spreads over the repeats do not overlap: "order consistent" says whether the predicted order
contradicts no such measured difference (the strict comparison is printed too).

Cost on this 2-core machine (AMD EPYC, load average 3-4 from other benchmarks): a compile takes
4-8 s (capture dominates; the Hugging Face models are the slow ones), a launch of 10 steps 8-25 s,
of which ~7 s is fixed (starting the elastic agent and the workers, importing torch, rendezvous,
loading the stages) and 4-process launches are the slow ones. The default run compiles 40 plans
(~4 min) and has 28 distinct plans to launch per repeat (~7 min): ~25 min with 3 repeats, 11 min
with `--repeats 1`; `--quick` takes under 2 min. The end of the report gives the run's totals.
Exit status 1 when any plan failed to compile, launch or measure (after the tables and
`--json` are written, with what did run): a plan partc emits that does not train is a bug.

One profile per case (default; `--no-one-profile` turns it off): each compile prices with the
profile cache's entry for the micro-batch sizes its own search measured, and entries measured
minutes apart differ by this VM's drift (run V, 2026-11-28: the ResNet's size 16 read 1.42x apart
in `cpsat`'s and `params`' profiles), so where a case's strategies' profiles differ, `partc
profile` measures one holding every size any of them holds (torch timing, one thread, the node's
other devices busy, as compile measures) and every strategy is compiled again with it
(`--profile`): a case's predictions then compare plans, not measurements.

The machine's drift (default; `--no-drift-check` skips it): after a case's launches its model
is measured again as its compiles measured it, and each plan's whole-model forward + backward at
its micro-batch size is compared with the profile that priced it. A prediction can only be
tested on a machine that runs at the speed it was priced at; the time bounds are printed over
every plan and over the plans whose case drifted by at most 5% ("steady"). Costs one profile
per case (5-30 s here). The drift check times core 0, as a profile does; each core of this VM
flips between a fast and a slow kernel mode on its own (bench/kernel_modes.py --every-core), so
each launch also counts its "slow steps": timed steps in which some stage's own work ran over
1.3x its price (fast steps read 1.0-1.15x, slow ones 1.5-1.8x, 2026-11-29). Against the
price: a case profiled in the slow mode and launched in the fast one shows none (its drift
reads below 1 instead).

`--microbatches M` pins the micro-batch count for every strategy, to compare the cuts alone: the
searched counts differ between strategies (e.g. the MLP: cpsat 8, uniform 4, predicted 0.5%
apart) and the per-micro-batch cost the model misses can outweigh a better cut on this machine.

`--calibrate DIR` prices this machine rather than the one the shipped `cpu` configs were
calibrated on: it runs `partc calibrate --seconds 20 --devices 4 -o DIR` first (the devices'
compute, memory, dispatch and pipelining-runtime overheads and the gloo link;
DIR/clusters/cpu-4.yaml is the node as 4 devices on its cores, its memory shared 4 ways, as
configs/clusters/cpu-4.yaml is the shipped cpu's), and compiles every case for
DIR/clusters/cpu.yaml or DIR/clusters/cpu-4.yaml. The shipped configs describe an Intel Xeon
VM; this project's machines are not always one (2026-12-01: an AMD EPYC whose stage-pass
overhead measured 111 us against the shipped 57 us).

    .venv/bin/python bench/plan_measured.py [--quick] [--models mlp,bert] [--processes 2,4]
        [--repeats 3] [--steps 10] [--microbatches M] [--order case|round] [--calibrate DIR]
        [--json rows.json]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import yaml

from partc.cost.speed_correction import probe_ratio
from partc.hardware.configs import load_cluster
from partc.options import PRECISIONS, STRATEGIES
from partc.plans.diff import costs_of_plan
from partc.plans.plan import load_plan
from partc.plans.report import replay_measured
from partc.plans.run_metrics import MEMORY_NONE, RunMetrics

ROOT = Path(__file__).resolve().parent.parent
PARTC = str(Path(sys.executable).parent / "partc")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

MODELS = ["mlp", "transformer", "bert", "gpt2", "resnet"]
BATCH = {"mlp": 4096, "transformer": 64, "bert": 32, "gpt2": 32, "resnet": 64}
BASELINES = ["uniform", "params", "chain-dp"]
# processes -> (cluster, pinned compile options)
CASES = {2: ("cpu", ["--stages", "2"]), 4: ("cpu-4", ["--stages", "4", "--replicas", "1"])}
WARMUP = 2


@dataclass
class Plan:
    """One strategy's compiled plan of one (model, processes) case."""
    model: str
    processes: int
    strategy: str
    directory: Path
    compile_s: float
    error: str | None = None
    shape: dict[str, Any] = field(default_factory=dict)
    key: tuple = ()
    predicted_iteration_s: float | None = None
    # where the device gives a speed spread, the iteration at the priced speed (the prediction
    # without the spread's expectation, partc.solve.stragglers); None: the same as predicted
    priced_speed_iteration_s: float | None = None
    predicted_samples_per_s: float | None = None
    same_as: str | None = None  # the strategy whose identical plan is launched instead
    profile_sha256: str | None = None  # plan.yaml's digest of the profile that priced it
    profile_path: Path | None = None  # that profile's file (plan.yaml's costs.profile)
    steps_s: list[float] = field(default_factory=list)  # measured step time per repeat
    mean_steps_s: list[float] = field(default_factory=list)  # the mean of the same steps
    launch_s: list[float] = field(default_factory=list)  # wall time of each launch
    predicted_peaks: list[int] = field(default_factory=list)  # memory model, per stage
    peaks: list[list[int]] = field(default_factory=list)  # measured per stage, per repeat
    # per repeat: the schedule simulated with that run's own stage times (partc show's replay;
    # on shared cores from the stages' CPU times)
    replayed_s: list[float] = field(default_factory=list)
    # per repeat, where the plan's cluster gives a wake credit: the same replay under processor
    # sharing (no credit), so one run shows what the shared-core model changes
    replayed_ps_s: list[float] = field(default_factory=list)
    # per repeat: the stages' measured forward + backward work over the predicted (wall times;
    # CPU times where processes share cores): the stage-cost model's part of the gap
    work_ratio: list[float] = field(default_factory=list)
    # per repeat, per stage: the same ratio stage by stage (where a cut's error sits)
    stage_work: list[list[float]] = field(default_factory=list)
    # the machine's drift over the case: the whole model's forward + backward at this plan's
    # micro-batch size, measured again after the case's launches, over the same in the profile
    # that priced the plan (`drift_check`); None where not measured
    drift: float | None = None
    # the same for the speed probe a profile times beside its totals (partc.cost.speed_probe):
    # the probe's median after the launches over the one in the profile that priced the plan.
    # Where it tracks `drift`, the probe sees what moved the model's speed
    probe_drift: float | None = None
    # the calibrated config's speed reference over the probe in the plan's profile (what the
    # probe read: partc.cost.speed_correction.probe_ratio), None: no probe or no reference
    probe_ratio: float | None = None
    # the factor the plan's profile was scaled by toward the calibrated config's mean speed
    # (the ratio's part beyond the band; `partc diff`'s "speed-corrected"), None: not corrected
    speed_factor: float | None = None
    # per repeat: (steps in which some stage's own forward + backward ran over SLOW_STEP x its
    # price, timed steps): a launch whose cores flipped into the slow mode part of the time
    # (bench/kernel_modes.py --every-core) shows as a few such steps, one spent in it as all
    slow_steps: list[tuple[int, int]] = field(default_factory=list)


SLOW_STEP = 1.3  # a stage's step work over this multiple of its price: the slow mode's range


def calibrated_clusters(out: Path) -> dict[int, str]:
    """`partc calibrate --seconds 20 --devices 4 -o out`: this machine's cpu cluster and its
    cpu-4 (the node as 4 processes sharing its cores, as the shipped cpu-4 is the shipped cpu's):
    process count -> cluster file."""
    proc = subprocess.run([PARTC, "calibrate", "--seconds", "20", "--devices", "4", "-o",
                           str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"partc calibrate failed: {last_line(proc.stderr)}")
    print(proc.stdout.rstrip(), flush=True)
    two, four = out / "clusters" / "cpu.yaml", out / "clusters" / "cpu-4.yaml"
    return {2: str(two), 4: str(four if four.exists() else two)}  # a 4-core node: cpu is it


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def compile_plan(model: str, processes: int, strategy: str, out: Path,
                 microbatches: int | None = None, precision: str = "fp32",
                 profile: Path | None = None, extra: Sequence[str] = ()) -> Plan:
    """`partc compile` of one case's strategy (`extra`: more compile options), read back from its
    plan.yaml: shape, identity key, predictions and profile."""
    cluster, pinned = CASES[processes]
    if microbatches:
        pinned = [*pinned, "--microbatches", str(microbatches)]
    pinned = [*pinned, "--precision", precision, *extra]
    if profile is not None:
        pinned = [*pinned, "--profile", str(profile)]
    start = time.perf_counter()
    proc = subprocess.run([PARTC, "compile", f"examples/{model}.py", "-b", str(BATCH[model]),
                           "--cluster", cluster, *pinned, "--strategy", strategy, "-o", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    plan = Plan(model, processes, strategy, out, time.perf_counter() - start)
    if proc.returncode != 0:
        plan.error = f"compile failed: {last_line(proc.stderr)}"
        return plan
    doc = yaml.safe_load((out / "plan.yaml").read_text())
    t = doc["training"]
    plan.shape = {"stages": t["stages"], "replicas": t["replicas"],
                  "num_microbatches": t["num_microbatches"],
                  "microbatch_size": t["microbatch_size"], "schedule": t["schedule"],
                  "virtual_stages_per_rank": t["virtual_stages_per_rank"],
                  "activation_checkpointing": t["activation_checkpointing"],
                  "placement": t["placement"]}
    # The stage hashes fix the cut (and the micro-batch shape the stages were traced at); the
    # shape adds what the stage files do not show (schedule, replicas, checkpointing).
    plan.key = (tuple(s["sha256"] for s in doc["stages"]), tuple(sorted(plan.shape.items())))
    ranks = [s["rank"] for s in doc["stages"]]
    plan.predicted_peaks = [int(doc["predicted"]["memory"][r]["total"]) for r in ranks]
    plan.predicted_iteration_s = float(doc["predicted"]["iteration_s"])
    spread = doc["predicted"].get("speed_spread")
    plan.priced_speed_iteration_s = (float(spread["iteration_at_priced_speed_s"]) if spread
                                     else None)
    plan.predicted_samples_per_s = float(doc["predicted"]["samples_per_s"])
    plan.profile_sha256 = doc["costs"].get("profile_sha256")
    if doc["costs"].get("profile"):  # relative to the plan's directory (or absolute)
        plan.profile_path = out / doc["costs"]["profile"]
    loaded = load_plan(out / "plan.yaml")
    plan.speed_factor = costs_of_plan(loaded).speed_factor
    if plan.profile_path is not None:
        priced = yaml.safe_load(plan.profile_path.read_text())
        plan.probe_ratio = probe_ratio(priced.get("kind"), priced.get("device"),
                                       priced.get("threads"), priced.get("calibration") or {},
                                       loaded.cluster.device)
    return plan


def case_profile(model: str, processes: int, plans: dict[str, Plan], precision: str,
                 out: Path) -> Path | None:
    """One profile for every strategy of a case, or None when their compiles already priced
    with one (the same profile file). Each compile prices with the profile cache's entry for
    the micro-batch sizes its own search measured, and entries measured minutes apart differ by
    the machine's drift (run V: 1.42x at the same size), so a case's predicted order would
    compare measurements, not plans. This profile holds every size any of the case's profiles
    holds, measured together as compile measures (torch timing, one thread, the node's other
    devices busy); the strategies are then compiled again with it."""
    priced = [p for p in plans.values() if p.error is None and p.profile_sha256]
    if len({p.profile_sha256 for p in priced}) <= 1:
        return None
    sizes = sorted({int(b) for p in priced if p.profile_path for b in
                    yaml.safe_load(p.profile_path.read_text())["batch_sizes"]})
    proc = measure_profile(model, processes, sizes, precision, out)
    if proc.returncode != 0:
        raise SystemExit(f"partc profile for {model} x{processes} failed: "
                         f"{last_line(proc.stderr)}")
    return out


def measure_profile(model: str, processes: int, sizes: list[int], precision: str,
                    out: Path) -> subprocess.CompletedProcess[str]:
    """`partc profile` of the model at `sizes`, measured as a compile for the case's cluster
    measures (torch timing, one thread, the node's other devices busy), written to `out`."""
    cluster = load_cluster(CASES[processes][0])
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run([PARTC, "profile", f"examples/{model}.py", "--batch-sizes",
                           ",".join(map(str, sizes)), "--method", "torch", "--precision",
                           precision, "--threads", "1", "--neighbours",
                           str(cluster.devices_per_node - 1), "-o", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)


def profile_probe(path: Path) -> float | None:
    """A profile file's speed probe median (seconds per call), None where it has none."""
    doc = yaml.safe_load(path.read_text())
    probe = (doc.get("calibration") or {}).get("speed_probe") or {}
    return float(probe["median_s"]) if "median_s" in probe else None


def profile_totals(path: Path) -> dict[int, float]:
    """A profile file's whole-model forward + backward seconds per batch size."""
    doc = yaml.safe_load(path.read_text())
    return {int(b): float(t["forward_s"]) + float(t["backward_s"])
            for b, t in (doc.get("totals_at_batch_sizes") or {}).items()}


def drift_check(model: str, processes: int, plans: dict[str, Plan], precision: str,
                out: Path) -> None:
    """Measure the case's model again after its launches, as its compiles measured it (torch
    timing, one thread, the node's other devices busy), and set each launched plan's `drift`:
    the whole model's forward + backward at the plan's micro-batch size now over the same in the
    profile that priced it. A prediction can only be checked against a machine that runs at the
    speed it was priced at: this VM's speed moved by up to 1.5x within minutes (runs U-Y), and a
    drift far from 1 says the gap in that case is the machine's, not the model's. Timed in the
    same process and rounds as a profile's totals, so the ratio compares like with like."""
    launched = [p for p in plans.values() if p.error is None and not p.same_as and p.steps_s
                and p.shape and p.profile_path is not None]
    before = {p.strategy: profile_totals(p.profile_path) for p in launched if p.profile_path}
    wanted = {int(p.shape["microbatch_size"]) for p in launched}
    known = sorted({b for totals in before.values() for b in totals})
    sizes = sorted(wanted | set(known[:1]))
    if not launched or len(sizes) < 2:
        return
    proc = measure_profile(model, processes, sizes, precision, out)
    if proc.returncode != 0:
        print(f"drift check of {model} x{processes} failed: {last_line(proc.stderr)}",
              file=sys.stderr, flush=True)
        return
    after = profile_totals(out)
    probe_after = profile_probe(out)
    for plan in launched:
        m = int(plan.shape["microbatch_size"])
        then = before[plan.strategy].get(m)
        if then and after.get(m):
            plan.drift = after[m] / then
        probe_then = profile_probe(plan.profile_path) if plan.profile_path else None
        if probe_then and probe_after:
            plan.probe_drift = probe_after / probe_then
    shown = ", ".join(f"{p.strategy} {p.drift:.3f}"
                      + (f" (probe {p.probe_drift:.3f})" if p.probe_drift is not None else "")
                      for p in launched if p.drift is not None)
    print(f"drift {model} x{processes} (fwd+bwd re-measured / as priced): {shown or '-'}",
          file=sys.stderr, flush=True)


def launch(plan: Plan, steps: int) -> None:
    """Train the plan once; append its median step time (or record the error)."""
    metrics = plan.directory / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # launch appends
    start = time.perf_counter()
    proc = subprocess.run([PARTC, "launch", str(plan.directory / "plan.yaml"), "--steps",
                           str(steps), "--metrics", str(metrics)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True)
    plan.launch_s.append(time.perf_counter() - start)
    if proc.returncode != 0 or not metrics.exists():
        plan.error = f"launch failed: {last_line(proc.stderr)}"
        return
    run = RunMetrics.load(metrics)
    # steps after the warm-up, without the one the CPU memory profiler watched (it is slower)
    timed = [st for st in run.steps[WARMUP:] if st.memory_method == MEMORY_NONE] or \
        list(run.timed_steps())
    plan.steps_s.append(statistics.median(st.step_s for st in timed))
    plan.mean_steps_s.append(statistics.fmean(st.step_s for st in timed))
    loaded = load_plan(plan.directory)
    replayed = replay_measured(loaded, run)
    if replayed is not None:
        plan.replayed_s.append(replayed.iteration_s)
        if loaded.cluster.wake_credit_s and loaded.pipeline_spec().shares_cores:
            sharing = replace(loaded, cluster=replace(loaded.cluster, wake_credit_s=0.0))
            plain = replay_measured(sharing, run)
            if plain is not None:
                plan.replayed_ps_s.append(plain.iteration_s)
    shared = loaded.pipeline_spec().shares_cores
    stages = run.stage_summaries()
    posts = loaded.p2p_posts_priced()  # what each pass's price holds of its p2p posts and waits
    work = [w for m in stages if (w := m.compute_s(shared, posts[m.index])) is not None]
    if len(work) == len(stages):
        predicted = sum(st.forward_s + st.backward_s for st in loaded.stages)
        plan.work_ratio.append(sum(fwd + bwd for fwd, bwd, _ in work) / predicted)
        plan.stage_work.append([(fwd + bwd) / (st.forward_s + st.backward_s)
                                for (fwd, bwd, _), st in zip(work, loaded.stages, strict=True)])
    prices = [st.forward_s + st.backward_s for st in loaded.stages]
    # each step's own work per stage (CPU times on shared cores)
    per_step = [[m.compute_s(shared, posts[m.index]) for m in step.stages] for step in timed]
    if prices and all(len(w) == len(prices) and None not in w for w in per_step):
        slow = sum(any(own is not None and own[0] + own[1] > SLOW_STEP * price
                       for own, price in zip(w, prices, strict=True))
                   for w in per_step)
        plan.slow_steps.append((slow, len(per_step)))
    peaks = [st for st in run.steps if st.memory_method != MEMORY_NONE]
    if peaks:
        plan.peaks.append([int(sm.peak_memory_bytes or 0) for sm in peaks[-1].stages])


def compile_all(model: str, n: int, tmp: Path, args: argparse.Namespace,
                profile: Path | None) -> dict[str, Plan]:
    """Every strategy's plan of one (model, processes) case, identical plans marked."""
    plans: dict[str, Plan] = {}
    for strategy in STRATEGIES:
        plan = compile_plan(model, n, strategy, tmp / f"{model}-{n}-{strategy}",
                            args.microbatches, args.precision, profile)
        same = [s for s, p in plans.items()
                if p.error is None and not p.same_as and p.key == plan.key]
        if plan.error is None and same:
            plan.same_as = same[0]
        plans[strategy] = plan
        print(f"compiled {model} x{n} {strategy} in {plan.compile_s:.1f} s"
              f"{' with the case profile' if profile else ''}"
              f"{': ' + plan.error if plan.error else ''}"
              f"{' (same plan as ' + plan.same_as + ')' if plan.same_as else ''}",
              file=sys.stderr, flush=True)
    return plans


def compile_case(model: str, n: int, tmp: Path,
                 args: argparse.Namespace) -> tuple[dict[str, Plan], bool]:
    """A case's plans, and whether they were compiled again with one profile (`case_profile`)."""
    plans = compile_all(model, n, tmp, args, None)
    if args.one_profile:
        shared = case_profile(model, n, plans, args.precision,
                              tmp / "profiles" / f"{model}-{n}.yaml")
        if shared is not None:
            return compile_all(model, n, tmp, args, shared), True
    return plans, False


def launch_case(plans: dict[str, Plan], r: int, repeats: int, steps: int) -> None:
    """Repeat r of a case: every distinct plan launched once, starting at a different plan each
    repeat (no strategy always runs right after a compile or another case's launches)."""
    todo = [p for p in plans.values() if p.error is None and not p.same_as]
    k = r % len(todo) if todo else 0
    for plan in todo[k:] + todo[:k]:
        launch(plan, steps)
        got = f"{plan.steps_s[-1] * 1e3:.1f} ms/step" if plan.error is None else plan.error
        print(f"repeat {r + 1}/{repeats} {plan.model} x{plan.processes} {plan.strategy}: {got} "
              f"(launch {plan.launch_s[-1]:.1f} s)", file=sys.stderr, flush=True)


def shape_text(shape: dict[str, Any]) -> str:
    v = shape["virtual_stages_per_rank"]
    return (f"{shape['stages']}x{shape['replicas']}, {shape['num_microbatches']} mb of "
            f"{shape['microbatch_size']}, {shape['schedule']}{f' (v{v})' if v > 1 else ''}, "
            f"ckpt {'on' if shape['activation_checkpointing'] else 'off'}")


def measured(plan: Plan, plans: dict[str, Plan]) -> Plan:
    """The plan whose launches stand for this one (itself, or the identical plan launched)."""
    return plans[plan.same_as] if plan.same_as else plan


def ranking(plans: dict[str, Plan], value: Any) -> str:
    """Distinct plans from fastest to slowest by value(plan) (seconds, shown in ms); strategies
    sharing a plan joined with '='."""
    groups: dict[str, list[str]] = {}
    for s, p in plans.items():
        if p.error is None and not p.same_as and measured(p, plans).steps_s:
            groups[s] = [s]
    for s, p in plans.items():
        if p.same_as in groups:
            groups[p.same_as].append(s)
    order = sorted(groups, key=lambda s: value(plans[s]))
    return " < ".join(f"{'='.join(groups[s])} ({value(plans[s]) * 1e3:.2f})" for s in order)


def consistent_order(plans: dict[str, Plan]) -> bool:
    """Whether the predicted order contradicts no measured one: for every two distinct plans
    whose measured step times over the repeats do not overlap (one's slowest repeat faster than
    the other's fastest), the prediction puts them the same way round."""
    launched = [p for p in plans.values() if p.error is None and not p.same_as and p.steps_s
                and p.predicted_iteration_s is not None]
    for a in launched:
        for b in launched:
            if max(a.steps_s) < min(b.steps_s) and \
                    (a.predicted_iteration_s or 0) > (b.predicted_iteration_s or 0):
                return False
    return True


STEADY = 0.05  # a case whose machine drift is within 5% ran at the speed it was priced at


def priced_drift(row: dict[str, Any]) -> float:
    """The machine's speed after a case's launches over the speed its plan was priced at: the
    drift over the profile, over the speed correction where the profile was scaled to the
    calibrated mean speed (partc.cost.speed_correction)."""
    return float(row["drift"]) / float(row.get("speed_factor") or 1.0)


def time_bounds(rows: list[dict[str, Any]]) -> None:
    """The issue's time bounds per process count: every distinct launched plan's measured
    iteration within 15% of its prediction, the median within 8%; over every plan, and over the
    plans whose case ran on a steady machine (`priced_drift` within STEADY), which alone can
    test a prediction: the others' gaps are the machine's speed moving under them."""
    print("\n| processes | plans | measured/predicted | within 8% | within 15% | median "
          "| steady plans (drift within 5%) | their measured/predicted | within 15% | median |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in sorted({r["processes"] for r in rows}):
        mine = [r for r in rows if r["processes"] == n and r["error"] is None
                and not r["same_plan_as"] and r["measured_over_predicted"] is not None]
        if not mine:
            continue
        steady = [r for r in mine if r["drift"] is not None
                  and abs(priced_drift(r) - 1) <= STEADY]

        def cells(group: list[dict[str, Any]], eight: bool) -> str:
            if not group:
                return "- | - | -" + (" | -" if eight else "")
            got = [r["measured_over_predicted"] for r in group]
            within = [sum(abs(g - 1) <= bound for g in got) for bound in (0.08, 0.15)]
            parts = [f"{min(got):.3f}-{max(got):.3f}"] + \
                ([f"{within[0]} of {len(got)}"] if eight else []) + \
                [f"{within[1]} of {len(got)}", f"{statistics.median(got):.3f}"]
            return " | ".join(parts)

        print(f"| {n} | {len(mine)} | {cells(mine, True)} | {len(steady)} "
              f"| {cells(steady, False)} |")
    spread_lines(rows)


def spread_lines(rows: list[dict[str, Any]]) -> None:
    """Where plans were priced over the devices' speed spread: the same launches against the
    prediction at the priced speed (the model without the spread's term), and their mean step
    (what the expectation prices) against the prediction."""
    plans = [r for r in rows if r["error"] is None and not r["same_plan_as"]
             and r["measured_step_s"] and r["predicted_at_priced_speed_s"]]
    if not plans:
        return
    print("\n| processes | plans | measured median / at the priced speed | within 15% | median "
          "| measured mean / predicted (expectation) | within 15% | median |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sorted({r["processes"] for r in plans}):
        mine = [r for r in plans if r["processes"] == n]
        priced = [r["measured_step_s"] / r["predicted_at_priced_speed_s"] for r in mine]
        means = [statistics.median(r["measured_mean_steps_s"]) / r["predicted_iteration_s"]
                 for r in mine if r["measured_mean_steps_s"]]
        cells = []
        for got in (priced, means):
            cells += [f"{min(got):.3f}-{max(got):.3f}",
                      f"{sum(abs(g - 1) <= 0.15 for g in got)} of {len(got)}",
                      f"{statistics.median(got):.3f}"] if got else ["-", "-", "-"]
        print(f"| {n} | {len(mine)} | " + " | ".join(cells) + " |")


def cpu_model() -> str:
    """The CPU's model name (platform.processor() is only the architecture on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def strip(order: str) -> str:
    """A ranking without its numbers."""
    return " < ".join(part.split(" (")[0] for part in order.split(" < "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="mlp and bert, 2 processes, 1 repeat, 6 steps (for make bench)")
    parser.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--processes", help="comma-separated subset of 2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int,
                        help="pin the micro-batch count for every strategy (default: searched)")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="the training precision every plan is compiled for")
    parser.add_argument("--order", default="case", choices=("case", "round"),
                        help="case: each case's repeats right after its compile (default); "
                             "round: compile everything, then one round of launches per repeat")
    parser.add_argument("--no-one-profile", dest="one_profile", action="store_false",
                        help="keep each strategy's plan as its own compile priced it, even "
                             "where the strategies' profiles differ (default: price a case's "
                             "strategies with one profile holding all their sizes)")
    parser.add_argument("--no-drift-check", dest="drift_check", action="store_false",
                        help="skip measuring each case's model again after its launches "
                             "(default: measure, and report the machine's drift beside each "
                             "prediction, `drift_check`)")
    parser.add_argument("--calibrate", type=Path, metavar="DIR",
                        help="run partc calibrate into DIR first and price every case with its "
                             "configs (default: the shipped cpu and cpu-4)")
    parser.add_argument("--json", type=Path, help="write the raw rows here")
    args = parser.parse_args()
    models = ["mlp", "bert"] if args.quick else MODELS
    processes = [2] if args.quick else sorted(CASES)
    repeats, steps = (1, 6) if args.quick else (args.repeats, args.steps)
    if args.models:
        models = [m for m in args.models.split(",") if m]
    if args.processes:
        processes = [int(p) for p in args.processes.split(",") if p]
    unknown = [m for m in models if m not in BATCH] + [str(p) for p in processes if p not in CASES]
    if unknown:
        raise SystemExit(f"unknown models/processes: {', '.join(unknown)}")
    if steps <= WARMUP:
        raise SystemExit(f"--steps must be more than the {WARMUP} warm-up steps")

    if args.calibrate is not None:
        for n, cluster in calibrated_clusters(args.calibrate).items():
            CASES[n] = (cluster, CASES[n][1])

    machine = {"processor": platform.processor() or platform.machine(),
               "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
               "python": platform.python_version(),
               "torch": importlib.metadata.version("torch"),
               "load_average_1m": round(os.getloadavg()[0], 2)}
    config = {"models": models, "processes": processes, "repeats": repeats, "steps": steps,
              "warmup_steps": WARMUP, "batch": {m: BATCH[m] for m in models},
              "clusters": {p: CASES[p][0] for p in processes}, "omp_num_threads": 1,
              "microbatches": args.microbatches or "searched", "precision": args.precision,
              "order": args.order, "one_profile": args.one_profile,
              "drift_check": args.drift_check}
    print(f"machine: {machine['processor']} ({machine['cpu_model']}), {machine['cpu_count']} "
          f"cpus, python {machine['python']}, torch {machine['torch']}, load average "
          f"{machine['load_average_1m']} at start")
    print(f"config: {repeats} repeats x {steps} steps (median of steps after {WARMUP} warm-up), "
          f"OMP_NUM_THREADS=1, batch {', '.join(f'{m} {BATCH[m]}' for m in models)}, "
          f"micro-batches {args.microbatches or 'searched'}, precision {args.precision}\n",
          flush=True)

    began = time.perf_counter()
    compile_s = 0.0
    one_profile: list[str] = []  # cases priced again with one profile (case_profile)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cases: dict[tuple[str, int], dict[str, Plan]] = {}

        every = [(model, n) for model in models for n in processes]

        def compiled(model: str, n: int) -> None:
            nonlocal compile_s
            start = time.perf_counter()
            cases[(model, n)], priced_again = compile_case(model, n, tmp, args)
            if priced_again:
                one_profile.append(f"{model} x{n}")
            compile_s += time.perf_counter() - start

        def drift(model: str, n: int) -> None:
            if args.drift_check:
                drift_check(model, n, cases[(model, n)], args.precision,
                            tmp / "profiles" / f"{model}-{n}-after.yaml")

        if args.order == "case":
            for model, n in every:
                compiled(model, n)
                for r in range(repeats):
                    launch_case(cases[(model, n)], r, repeats, steps)
                drift(model, n)
        else:
            for model, n in every:
                compiled(model, n)
            for r in range(repeats):
                for model, n in every:
                    launch_case(cases[(model, n)], r, repeats, steps)
            for model, n in every:
                drift(model, n)
    total_s = time.perf_counter() - began

    rows: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    print("| model | processes | strategy | shape (S x R, micro-batches, schedule, ckpt) "
          "| predicted ms/iter | measured ms/iter | measured/predicted | measured samples/s "
          "| same plan as |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (model, n), plans in cases.items():
        batch = BATCH[model]
        for strategy, plan in plans.items():
            m = measured(plan, plans)
            error = plan.error or m.error
            step = statistics.median(m.steps_s) if m.steps_s and error is None else None
            row = {"model": model, "processes": n, "cluster": CASES[n][0],
                   "global_batch": batch, "strategy": strategy, "shape": plan.shape or None,
                   "predicted_iteration_s": plan.predicted_iteration_s,
                   "predicted_samples_per_s": plan.predicted_samples_per_s,
                   "measured_step_s": step, "measured_steps_s": list(m.steps_s),
                   "measured_mean_steps_s": list(m.mean_steps_s),
                   "predicted_at_priced_speed_s": plan.priced_speed_iteration_s,
                   "measured_samples_per_s": batch / step if step else None,
                   "measured_over_predicted": (step / plan.predicted_iteration_s
                                               if step and plan.predicted_iteration_s else None),
                   "predicted_peak_bytes": plan.predicted_peaks,
                   "measured_peak_bytes": m.peaks,
                   "replayed_steps_s": list(m.replayed_s),
                   "replayed_processor_sharing_steps_s": list(m.replayed_ps_s),
                   "stage_work_ratio": list(m.work_ratio),
                   "per_stage_work_ratio": list(m.stage_work), "drift": m.drift,
                   "probe_drift": m.probe_drift, "probe_ratio": plan.probe_ratio,
                   "speed_factor": plan.speed_factor,
                   "slow_steps": [list(x) for x in m.slow_steps],
                   "same_plan_as": plan.same_as, "error": error,
                   "compile_s": plan.compile_s, "launch_s": list(plan.launch_s)}
            rows.append(row)
            if error:
                shape = shape_text(plan.shape) if plan.shape else "-"
                print(f"| {model} | {n} | {strategy} | {shape} "
                      f"| {(plan.predicted_iteration_s or 0) * 1e3:.2f} | {error} | - | - "
                      f"| {plan.same_as or ''} |")
                continue
            spread = (f" ({min(m.steps_s) * 1e3:.0f}-{max(m.steps_s) * 1e3:.0f})"
                      if len(m.steps_s) > 1 else "")
            print(f"| {model} | {n} | {strategy} | {shape_text(plan.shape)} "
                  f"| {(plan.predicted_iteration_s or 0) * 1e3:.2f} "
                  f"| {(step or 0) * 1e3:.1f}{spread} "
                  f"| {row['measured_over_predicted']:.2f}x | {row['measured_samples_per_s']:,.0f} "
                  f"| {plan.same_as or ''} |")

    order_rows: list[dict[str, Any]] = []
    print("\n| model | processes | cpsat samples/s | vs uniform | vs params | vs chain-dp "
          "| predicted order (fastest first) | measured order | order matches "
          "| order consistent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (model, n), plans in cases.items():
        cp = measured(plans["cpsat"], plans)
        ok = plans["cpsat"].error is None and cp.error is None and bool(cp.steps_s)
        cells = []
        for base in BASELINES:
            b = measured(plans[base], plans)
            if not ok or plans[base].error or b.error or not b.steps_s:
                cells.append("-")
                continue
            # per repeat: cpsat samples/s over baseline samples/s = baseline step / cpsat step
            # (strict: every error-free plan was launched once per repeat)
            ratio = statistics.median(bs / cs for bs, cs in zip(b.steps_s, cp.steps_s,
                                                                strict=True))
            ratios.append({"model": model, "processes": n, "baseline": base,
                           "cpsat_over_baseline": ratio, "same_plan": b is cp})
            cells.append("same plan" if b is cp else f"{ratio:.2f}x")
        pred = ranking(plans, lambda p: p.predicted_iteration_s)
        meas = ranking(plans,
                       lambda p, plans=plans: statistics.median(measured(p, plans).steps_s))
        # the same sequence of plans, whatever the numbers
        match = "yes" if strip(pred) == strip(meas) else "no"
        consistent = "yes" if consistent_order(plans) else "no"
        if "<" not in pred:
            match = consistent = "one plan"
        order_rows.append({"model": model, "processes": n, "predicted": pred, "measured": meas,
                           "strict": match, "consistent": consistent})
        rate = f"{BATCH[model] / statistics.median(cp.steps_s):,.0f}" if ok else "-"
        print(f"| {model} | {n} | {rate} | {' | '.join(cells)} | {pred or '-'} | {meas or '-'} "
              f"| {match} | {consistent} |")

    print("\nThe schedule alone: each run replayed by the simulator with its own per-stage "
          "forward, backward and optimizer times (`partc show --metrics`; where processes "
          "share cores, their CPU times, which the simulator shares out with the cluster's "
          "wake credit, and beside it without: processor sharing), so the stage-cost "
          "model's errors drop out; and those errors: the stages' measured forward + backward "
          "work over the predicted.\n")
    print("| model | processes | strategy | measured ms/iter | replayed ms/iter "
          "| measured/replayed (per repeat) | the same under processor sharing "
          "| stage work measured/predicted | per stage (median) | slow steps | machine drift "
          "(probe's) | speed correction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, n), plans in cases.items():
        for strategy, plan in plans.items():
            if plan.error or plan.same_as or not plan.replayed_s:
                continue
            each = [a / b for a, b in zip(plan.steps_s, plan.replayed_s, strict=True)]
            work = (f"{statistics.median(plan.work_ratio):.3f} ({min(plan.work_ratio):.3f}-"
                    f"{max(plan.work_ratio):.3f})" if plan.work_ratio else "-")
            per_stage = " ".join(f"{statistics.median(r):.2f}"
                                 for r in zip(*plan.stage_work, strict=True)) or "-"
            slow = " ".join(f"{k}/{n}" for k, n in plan.slow_steps) or "-"
            plain = [a / b for a, b in zip(plan.steps_s, plan.replayed_ps_s, strict=True)] \
                if plan.replayed_ps_s else []
            ps = (f"{statistics.median(plain):.3f} ({min(plain):.3f}-{max(plain):.3f})"
                  if plain else "-")
            print(f"| {model} | {n} | {strategy} | {statistics.median(plan.steps_s) * 1e3:.1f} "
                  f"| {statistics.median(plan.replayed_s) * 1e3:.1f} "
                  f"| {statistics.median(each):.3f} ({min(each):.3f}-{max(each):.3f}) | {ps} "
                  f"| {work} "
                  f"| {per_stage} | {slow} "
                  f"| {f'{plan.drift:.3f}' if plan.drift is not None else '-'}"
                  f"{f' ({plan.probe_drift:.3f})' if plan.probe_drift is not None else ''} "
                  f"| {f'{1 / plan.probe_ratio:.3f}' if plan.probe_ratio else '-'}: "
                  f"{f'x{plan.speed_factor:.3f}' if plan.speed_factor is not None else 'none'} |")
    print(f"\nslow steps: per repeat, the timed steps in which some stage's own forward + "
          f"backward ran over {SLOW_STEP:g}x its price, of all timed steps (this VM's slow "
          "kernel mode, per core: bench/kernel_modes.py --every-core)")
    if args.drift_check:
        print("\nmachine drift: the whole model's forward + backward at the plan's micro-batch "
              "size, measured again after the case's launches, over the same in the profile "
              "that priced the plan (1.000: the machine ran at the speed it was priced at); in "
              "brackets the same for the speed probe timed beside those totals "
              "(partc.cost.speed_probe)")
    print("\nspeed correction: the profile's speed probe over the calibrated config's mean "
          "(1.000: profiled at the mean speed), then the factor the profile was scaled by: the "
          "part beyond the probe's noise band (partc.cost.speed_correction), none within it")
    time_bounds(rows)

    # the bound is "never below" in bytes: the ratio's rounding hides a few KB, so each stage's
    # margin is also given exactly, against the highest peak any repeat measured
    print("\n| model | processes | strategy | stage | measured peak MiB (median) "
          "| predicted MiB | predicted/measured | predicted - highest measured, bytes |")
    print("|---|---|---|---|---|---|---|---|")
    stages = below = 0
    for (model, n), plans in cases.items():
        for strategy, plan in plans.items():
            if plan.error or plan.same_as or not plan.peaks:
                continue
            for k, peak in enumerate(plan.predicted_peaks):
                got = statistics.median(r[k] for r in plan.peaks)
                margin = peak - max(r[k] for r in plan.peaks)
                stages += 1
                below += margin < 0
                print(f"| {model} | {n} | {strategy} | {k} | {got / 2**20:,.1f} "
                      f"| {peak / 2**20:,.1f} | {peak / got if got else 0:.3f} "
                      f"| {margin:,.0f}{' **below**' if margin < 0 else ''} |")
    print(f"\n{stages - below} of {stages} stages never below their predicted peak")

    launches = [s for plans in cases.values() for p in plans.values() for s in p.launch_s]
    compiles = [p.compile_s for plans in cases.values() for p in plans.values()]
    print(f"\n{len(compiles)} compiles in {compile_s:.0f} s ({min(compiles):.1f}-"
          f"{max(compiles):.1f} s each), {len(launches)} launches in {sum(launches):.0f} s "
          + (f"({min(launches):.1f}-{max(launches):.1f} s each), " if launches else "")
          + f"{total_s / 60:.1f} min in all")
    print("cases priced again with one profile holding all their strategies' sizes (their "
          f"compiles' profiles differed): {', '.join(one_profile) or 'none'}")
    if 4 in processes:
        print("4 processes share the 2 cores (2 per core, pinned); the predictions time-share "
              "each core between the processes busy on it (cpu-4: cores_per_node 2).")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "config": config, "rows": rows,
                                         "ratios": ratios, "orders": order_rows,
                                         "one_profile_cases": one_profile,
                                         "total_s": total_s}, indent=1) + "\n")
    # a plan partc emitted that does not train is a bug, not a blank row: fail the run (after
    # the tables and the JSON, so what did run is kept)
    failed = [f"{r['model']} x{r['processes']} {r['strategy']}" for r in rows if r["error"]]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(rows)} plans did not compile, launch or measure: "
                         f"{', '.join(failed)}")


if __name__ == "__main__":
    main()
