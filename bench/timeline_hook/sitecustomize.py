"""A launch worker's per-pass timeline, for bench/launch_timeline.py (not part of partc).

Python imports `sitecustomize` at start-up from PYTHONPATH; bench/launch_timeline.py puts this
folder there and sets PARTC_TIMELINE_DIR for a `partc launch`, and in each worker (LOCAL_RANK set,
or, for ranks forked from launch's forkserver, once the rank starts) this wraps, from outside
partc, what a step is made of: every stage forward and backward (`TimedStage`, with its thread's
CPU time), every p2p post and wait of torch's schedules, the tied-gradient sum, launch's per-step
metrics gather (its post at a step's end and its wait a step later), the step's other parts (its
inputs, the early receives, the schedule's step), and the step itself (`partc.run.runtime._step`,
with the CPU time the process and its main thread spent in it). Each pass also records its thread's
time runnable but waiting for the core and its count of times scheduled in (/proc schedstat), and
each timed call its main-thread CPU time. Times are CLOCK_MONOTONIC, one clock for every process of
the machine, so the ranks' timelines line up. After each step the rank's events of that step are
appended to PARTC_TIMELINE_DIR/rank<R>.jsonl as one JSON line of [kind, start_s, end_s, detail]
rows: appending only the new rows keeps the hook's own cost per step constant (rewriting the whole
log after each step grew the gap between steps by ~0.4 ms a step, 2.7 -> 13 ms over 26 MLP steps).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _schedstat() -> tuple[float, int]:
    """This thread's time runnable but not running (s) and its count of times scheduled in
    (/proc/thread-self/schedstat; zeros where the kernel has none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            _, delay, slices = f.read().split()
    except (OSError, ValueError):
        return 0.0, 0
    return int(delay) / 1e9, int(slices)


def _install(out: str, rank: str) -> None:
    import torch.distributed.pipelining.schedules as schedules

    import partc.run.runtime as runtime
    import partc.run.stage_runner as stage_runner

    log: list[tuple[str, float, float, Any]] = []
    path = os.path.join(out, f"rank{rank}.jsonl")
    post, wait = schedules._batch_p2p, schedules._wait_batch_p2p
    if os.environ.get("PARTC_TIMELINE_GLOO_IO") == "other":
        # an experiment: leave gloo's socket loops at the default policy (launch moves them to
        # SCHED_BATCH, partc.hardware.local.batch_schedule_gloo_io)
        runtime.batch_schedule_gloo_io = lambda: 0

    # each timed call also logs its main-thread CPU time as a zero-length "cpu:<kind>" row, so
    # the step's main-thread CPU outside the passes splits into its parts; `detail` is the
    # row's detail, or a function of the call's arguments that gives it
    def timed(kind: str, fn: Callable[..., Any], detail: Any = None) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start, cpu = _now(), time.thread_time()
            result = fn(*args, **kwargs)
            end = _now()
            log.append((kind, start, end, detail(*args) if callable(detail) else detail))
            log.append((f"cpu:{kind}", end, end, time.thread_time() - cpu))
            return result
        return wrapper

    # P2PTimer wraps these in turn
    schedules._batch_p2p = timed(
        "post", post, lambda ops, *_: [op.op.__name__ for op in ops])
    schedules._wait_batch_p2p = timed("wait", wait)

    def timed_pass(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            queued, slices = _schedstat()
            start, cpu = _now(), time.thread_time()
            result = method(self, *args, **kwargs)
            end, cpu = _now(), time.thread_time() - cpu
            chunk = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
            queued_end, slices_end = _schedstat()
            # [micro-batch, CPU s, s runnable but waiting for the core, times scheduled in]
            log.append((kind, start, end, [chunk, cpu, queued_end - queued, slices_end - slices]))
            return result
        return run

    stage = stage_runner.TimedStage
    stage.forward_one_chunk = timed_pass("F", stage.forward_one_chunk)  # type: ignore[method-assign]
    stage.backward_one_chunk = timed_pass("B", stage.backward_one_chunk)  # type: ignore[method-assign]
    runtime.sum_tied_gradients = timed("tied", runtime.sum_tied_gradients)
    # the step's other parts, for the CPU they take outside the passes
    import partc.run.schedule as run_schedule
    run_schedule.RankRun.next_inputs = timed(  # type: ignore[method-assign]
        "inputs", run_schedule.RankRun.next_inputs)
    run_schedule.P2PTimer.post_receives = timed(  # type: ignore[method-assign]
        "receives", run_schedule.P2PTimer.post_receives)
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        cls.step = timed("schedule", cls.step)  # type: ignore[method-assign]
    rows = runtime._MetricsRows
    # the per-step metrics gather: posted at a step's end, waited in the next step
    rows.post = timed("gather", rows.post, "post")  # type: ignore[method-assign]
    rows.collect = timed("gather", rows.collect, "wait")  # type: ignore[method-assign]
    step = runtime._step

    def timed_step(run: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        start, process, thread = _now(), time.process_time(), time.thread_time()
        log.append(("step", start, start, index))
        result = step(run, index, *args, **kwargs)
        end = _now()
        # the step's CPU time, the whole process's (gloo's threads too) and the main thread's
        log.append(("cpu", end, end, [time.process_time() - process, time.thread_time() - thread]))
        log.append(("step_end", start, end, index))
        with open(path, "a") as f:
            f.write(json.dumps(log) + "\n")
        log.clear()
        return result

    runtime._step = timed_step  # type: ignore[assignment]


def _install_at_rank_start() -> None:
    """`partc launch` forks its ranks from a forkserver, which imported this at its own start,
    before any rank's variables were set: wrap the rank's entry point instead, which installs
    the hook once the rank knows its RANK."""
    import partc.run.worker as worker

    run_worker = worker.run_worker

    def hooked(*args: Any, **kwargs: Any) -> Any:
        _install(os.environ["PARTC_TIMELINE_DIR"], os.environ.get("RANK", "0"))
        return run_worker(*args, **kwargs)

    worker.run_worker = hooked


if os.environ.get("PARTC_TIMELINE_DIR"):
    if os.environ.get("LOCAL_RANK") is not None:  # a rank torchrun started itself
        _install(os.environ["PARTC_TIMELINE_DIR"], os.environ.get("RANK", "0"))
    else:  # the launcher, or the forkserver its ranks are forked from
        _install_at_rank_start()
