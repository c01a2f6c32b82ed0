"""Ctrl-C, SIGTERM and failures mid-way, through the real `partc` CLI: real processes, real
signals, no mocks.

What this file guarantees:

* `partc compile` stops promptly on SIGINT (exit 130, one line `partc: interrupted`) and on
  SIGTERM (exit 143, `partc: terminated`), also in the middle of a CP-SAT solve, and leaves the
  previous plan directory byte for byte as it was, with nothing beside it (no temporary
  directory, no stray file);
* a compile that fails after the solve leaves the previous plan as it was too; one that
  succeeds replaces the plan whole and keeps the user's files in it; `-o` naming a directory that
  is not a plan is refused before anything runs;
* after a CP-SAT solve Python's SIGINT handler is in charge (Ctrl-C raises KeyboardInterrupt
  instead of killing the process);
* `partc launch` on SIGINT (to the launcher, or to its process group as a terminal sends it)
  stops every worker, prints one line `partc launch: interrupted ...` and exits 130;
* a launch where one rank fails names that rank and its error, not a rank torn down after it.
* a launcher or compile killed by SIGKILL, which can stop nothing, leaves no worker or busy
  neighbour computing: they end themselves once their parent is gone.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, ROOT, TEST_MODELS, launched_ranks, named_descendants
from test_bad_inputs import MLP, PARTC, _context, assert_one_line_error, run

WIDE = str(TEST_MODELS / "wide_dag.py")


# ---- helpers -----------------------------------------------------------------------------------

def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every entry under `directory` (recursively): a file's bytes, a symlink's target, 'dir'."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        key = str(path.relative_to(directory))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            found[key] = "dir"
        else:
            found[key] = path.read_bytes()
    return found


def old_plan(tmp: Path) -> Path:
    """A plan directory as a user has it: a checked-in plan plus a file of the user's."""
    plan_dir = tmp / "plan"
    shutil.copytree(EXAMPLES / "plans" / "mlp", plan_dir)
    (plan_dir / "NOTES.md").write_text("my notes\n")
    return plan_dir


class Watched:
    """A `partc ...` process whose stderr is read as it comes (for waiting on a step)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 new_session: bool = False) -> None:
        self.proc = subprocess.Popen([PARTC, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=new_session)
        self.lines: list[str] = []
        self.stdout = ""
        self._changed = threading.Condition()
        self._readers = [threading.Thread(target=self._read_stderr, daemon=True),
                         threading.Thread(target=self._read_stdout, daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.stdout = self.proc.stdout.read()

    def wait_for(self, pattern: str, timeout: float = 240) -> str:
        """The first stderr line matching `pattern` (a regex); fails on timeout or exit."""
        regex = re.compile(pattern)
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                hit = next((ln for ln in self.lines if regex.search(ln)), None)
                if hit is not None:
                    return hit
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._readers[0].is_alive()):
                    raise AssertionError(f"no stderr line matching {pattern!r}:\n" + self.text())
                self._changed.wait(min(left, 0.2))

    def finish(self, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL) if self._own_group() \
                    else self.proc.kill()
                self.proc.wait(30)
        for reader in self._readers:
            reader.join(30)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, self.stdout,
                                           self.text())

    def _own_group(self) -> bool:
        try:
            return os.getpgid(self.proc.pid) == self.proc.pid
        except OSError:
            return False

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def assert_interrupted(proc: subprocess.CompletedProcess[str], code: int, line: str) -> None:
    """Exit `code`, exactly one `line` on stderr (its last line), no traceback."""
    context = _context(proc)
    assert proc.returncode == code, context
    assert proc.stderr.splitlines().count(line) == 1, context
    assert proc.stderr.rstrip("\n").splitlines()[-1] == line, context
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, context


# ---- compile: interrupted, failed, replaced ----------------------------------------------------

# SIGINT's clean-up is SIGTERM's (the CLI turns SIGTERM into KeyboardInterrupt), and launch's
# Ctrl-C tests send SIGINT in the default run: this one's SIGINT case is the slow set's
@pytest.mark.parametrize("sig, code, line", [
    pytest.param(signal.SIGINT, 130, "partc: interrupted", marks=pytest.mark.slow),
    (signal.SIGTERM, 143, "partc: terminated"),
], ids=["SIGINT", "SIGTERM"])
def test_compile_interrupted_in_the_solve_keeps_the_old_plan(
        sig: signal.Signals, code: int, line: str, tmp_path: Path) -> None:
    plan_dir = old_plan(tmp_path)
    before, listing = snapshot(tmp_path), sorted(os.listdir(tmp_path))
    # an interleaved shape of a wide DAG: CP-SAT searches for minutes (measured: > 100 s)
    watched = Watched(["compile", WIDE, "-b", "512", "--cluster", "cpu-4", "--costs", "analytic",
                       "--stages", "4", "--replicas", "1", "--microbatches", "8",
                       "--schedule", "interleaved-1f1b", "--time-limit", "300",
                       "-o", str(plan_dir)])
    watched.wait_for(r"^  \.\. cpsat: S\d")  # the solve of a shape has started
    time.sleep(1.0)  # well inside it
    sent = time.monotonic()
    watched.proc.send_signal(sig)
    proc = watched.finish(timeout=60)
    stopped_s = time.monotonic() - sent
    assert_interrupted(proc, code, line)
    context = _context(proc)
    assert any(ln.startswith("  failed cpsat: S") for ln in proc.stderr.splitlines()), context
    assert stopped_s < 15, (stopped_s, context)  # CP-SAT stopped at once, not at its time limit
    assert sorted(os.listdir(tmp_path)) == listing, context  # nothing beside the plan
    assert snapshot(tmp_path) == before, context  # the old plan, byte for byte


def test_compile_failing_after_the_solve_keeps_the_old_plan(tmp_path: Path) -> None:
    plan_dir = old_plan(tmp_path)
    before, listing = snapshot(tmp_path), sorted(os.listdir(tmp_path))
    # micro-batches of 1 (-b 8 in 8): the model refuses batch size 1, which emit asks for
    proc = run("compile", str(TEST_MODELS / "no_batch_of_one.py"), "-b", "8", "--cluster",
               "cpu-4", "--costs", "analytic", "--stages", "2", "--replicas", "1",
               "--microbatches", "8", "-o", str(plan_dir))
    assert_one_line_error(proc, "example_inputs(1)", "no inputs of batch size 1")
    context = _context(proc)
    solved = [i for i, ln in enumerate(proc.stderr.splitlines())
              if ln.startswith("  ok ") and "search" in ln]
    assert solved, context  # it failed after the search, in emit
    assert sorted(os.listdir(tmp_path)) == listing, context
    assert snapshot(tmp_path) == before, context


def test_compile_replaces_the_plan_whole_and_keeps_the_users_files(tmp_path: Path) -> None:
    plan_dir = old_plan(tmp_path)
    (plan_dir / "stage_7.pt").write_bytes(b"an earlier plan's stage")
    (plan_dir / ".stage_0.pt.staged").write_bytes(b"left by an interrupted older partc")
    (plan_dir / "runs").mkdir()
    (plan_dir / "runs" / "metrics.jsonl").write_text("{}\n")
    (plan_dir / "latest").symlink_to("runs")
    proc = run("compile", MLP, "-b", "8", "--cluster", "cpu-4", "--costs", "analytic",
               "--stages", "2", "--replicas", "1", "-o", str(plan_dir))
    context = _context(proc)
    assert proc.returncode == 0, context
    assert sorted(os.listdir(tmp_path)) == ["plan"], context  # no temporary directory left
    assert sorted(os.listdir(plan_dir)) == [
        "NOTES.md", "latest", "plan.yaml", "runs", "stage_0.pt", "stage_1.pt", "timings.yaml"]
    assert (plan_dir / "NOTES.md").read_text() == "my notes\n"
    assert (plan_dir / "runs" / "metrics.jsonl").read_text() == "{}\n"
    assert os.readlink(plan_dir / "latest") == "runs"
    plan = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    # built beside the plan directory, but every path is relative to the plan directory itself
    assert plan["model"]["file"] == os.path.relpath(MLP, plan_dir)
    assert plan["costs"]["source"] == "analytic"  # the old measured profile.yaml went with it
    assert run("verify", str(plan_dir)).returncode == 0


@pytest.mark.parametrize("kind", ["project", "cwd"])
def test_compile_refuses_an_output_that_is_not_a_plan(kind: str, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("print('mine')\n")
    before = snapshot(tmp_path)
    if kind == "project":
        proc = run("compile", MLP, "-b", "8", "--cluster", "cpu-4", "-o", str(project))
        assert_one_line_error(proc, "is not a plan directory", "train.py")
    else:  # `-o .` inside a plan directory would swap the current directory away
        plan_dir = old_plan(tmp_path)
        before = snapshot(tmp_path)
        proc = subprocess.run([PARTC, "compile", MLP, "-b", "8", "--cluster", "cpu-4", "-o", "."],
                              capture_output=True, text=True, cwd=plan_dir, timeout=300)
        assert_one_line_error(proc, "current directory")
    assert snapshot(tmp_path) == before, _context(proc)


# ---- CP-SAT and SIGINT -------------------------------------------------------------------------

SOLVE_THEN_CTRL_C = textwrap.dedent("""
    import os, signal, sys, threading, time
    from ortools.sat.python import cp_model
    from partc.cost.roofline import analytic_cost_table
    from partc.frontend.capture import capture_graph
    from partc.hardware.configs import load_cluster
    from partc.options import TrainingConfig
    from partc.solve.coarsen import coarsen
    from partc.solve.stage_problem import PipelineShape, StageProblem
    from partc.solve.strategies.cpsat import _run_solver, solve_cpsat

    cluster = load_cluster("cpu-4")
    table = analytic_cost_table(capture_graph(sys.argv[1], 2, onnx=False).graph, cluster.device)
    shape = PipelineShape(stages=2, replicas=1, num_microbatches=4, microbatch_size=2,
                          schedule="1f1b")
    problem = StageProblem.build(coarsen(table, 32), table, cluster, TrainingConfig(), shape)
    first = solve_cpsat(problem, time_limit_s=5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert solve_cpsat(problem, time_limit_s=5).assignment == first.assignment  # deterministic

    def ctrl_c(label):  # Ctrl-C must raise KeyboardInterrupt now, not kill the process
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
        except KeyboardInterrupt:
            print(label, "ok", flush=True)
            return
        print(label, "not interrupted", flush=True)
    ctrl_c("after solve_cpsat:")

    # A solver with CP-SAT's default (catch_sigint_signal on) leaves SIG_DFL behind at the OS
    # level; _run_solver puts Python's handler back.
    model = cp_model.CpModel()
    xs = [model.new_int_var(0, 59, f"x{i}") for i in range(60)]
    model.add_all_different(xs)
    model.add_all_different([x + i for i, x in enumerate(xs)])
    model.add_all_different([x - i for i, x in enumerate(xs)])
    model.minimize(sum((i % 7) * x for i, x in enumerate(xs)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 0.5
    _run_solver(solver, model)
    ctrl_c("after a catching solver:")

    # Ctrl-C during a long solve stops it promptly.
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 60
    solver.parameters.catch_sigint_signal = False
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        _run_solver(solver, model)
        print("during a solve: not interrupted", flush=True)
    except KeyboardInterrupt:
        print(f"during a solve: ok after {time.monotonic() - start:.1f} s", flush=True)
    ctrl_c("after an interrupted solve:")
""")


def test_cpsat_leaves_pythons_sigint_handler_in_place() -> None:
    proc = subprocess.run([sys.executable, "-c", SOLVE_THEN_CTRL_C,
                           str(TEST_MODELS / "deep_chain.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=240)
    context = _context(proc)
    assert proc.returncode == 0, context  # -2: a SIGINT killed the process
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["after solve_cpsat: ok", "after a catching solver: ok"], context
    assert lines[2].startswith("during a solve: ok after "), context
    assert float(lines[2].split()[-2]) < 5, context  # stopped, not at the 60 s time limit
    assert lines[3:] == ["after an interrupted solve: ok"], context


# ---- launch: Ctrl-C and the first failure ------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("launch") / "mlp"
    proc = run("compile", MLP, "-b", "8", "--cluster", "cpu-4", "--costs", "analytic",
               "--stages", "2", "--replicas", "1", "-o", str(out))
    assert proc.returncode == 0, _context(proc)
    return out


@pytest.mark.parametrize("target", ["launcher", "group"])
def test_launch_ctrl_c_stops_every_worker(target: str, mlp_plan: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    watched = Watched(["launch", str(mlp_plan), "--steps", "100000", "--log-every", "1",
                       "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"],
                      new_session=True)
    watched.wait_for(r"^step 3/", timeout=180)  # training
    workers = list(launched_ranks(watched.proc.pid).values())
    assert len(workers) == 2, (workers, watched.text())
    if target == "launcher":
        watched.proc.send_signal(signal.SIGINT)
    else:  # a terminal's Ctrl-C: the whole foreground process group
        os.killpg(watched.proc.pid, signal.SIGINT)
    proc = watched.finish(timeout=90)
    context = _context(proc)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("partc launch: interrupted")]
    assert proc.returncode == 130, context
    assert len(lines) == 1 and "SIGINT" in lines[0], context
    assert "rerun with --resume to continue from step " in lines[0], context  # a checkpoint
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, context
    assert not [p for p in workers if _alive(p)], context  # no orphan worker


FORKSERVER_SIGINT = """
import json, multiprocessing, time
from multiprocessing import forkserver
from partc.hardware.forkserver import start_forkserver

def sigint(pid):  # (ignored, caught by a handler) from /proc
    fields = {line.split(":")[0]: int(line.split()[1], 16)
              for line in open(f"/proc/{pid}/status") if line.startswith(("SigIgn", "SigCgt"))}
    return [bool(fields["SigIgn"] & 2), bool(fields["SigCgt"] & 2)]

start_forkserver(["torch", "torch.distributed"])
server = forkserver._forkserver._forkserver_pid
time.sleep(0.2)
importing = sigint(server)  # importing torch: seconds
child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(3,))
child.start()  # forked once the imports are done
time.sleep(0.5)
print(json.dumps([importing, sigint(child.pid)]))
child.join()
"""


def test_the_forkserver_ignores_ctrl_c_while_it_imports_and_its_children_do_not() -> None:
    """A terminal's Ctrl-C reaches the whole foreground group, the forkserver of launch (and of
    calibrate) with it, which spends its first seconds importing torch: it died there with a
    KeyboardInterrupt traceback on the user's terminal. It now starts with SIGINT ignored, and
    the processes it forks have Python's handler again (partc.hardware.forkserver)."""
    proc = subprocess.run([sys.executable, "-c", FORKSERVER_SIGINT], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    importing, child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert importing == [True, False]  # ignored while it imports
    assert child == [False, True]  # a forked process: KeyboardInterrupt, as a spawned one


FORKSERVER_ABANDONED = """
import _multiprocessing, json, multiprocessing, sys
from multiprocessing import resource_tracker
from partc.hardware.forkserver import start_forkserver

class Broken:  # unpickles to int("x"): a start failure of another kind
    def __reduce__(self):
        return (int, ("x",))

start_forkserver([])
context = multiprocessing.get_context("forkserver")
lock = context.Lock()
# what launch's agent does to its ranks' semaphores when a Ctrl-C tears it down
_multiprocessing.sem_unlink(lock._semlock.name)
resource_tracker.unregister(lock._semlock.name, "semaphore")
codes = []
for args in ((lock,), (Broken(),)):
    child = context.Process(target=id, args=args)
    child.start()
    child.join()
    codes.append(child.exitcode)
    print("--- started", flush=True, file=sys.stderr)
print(json.dumps(codes))
"""


def test_a_rank_whose_launch_was_torn_down_while_it_was_forked_exits_without_a_traceback() -> None:
    """A Ctrl-C while launch's ranks are being forked (2.5-3 s after the start here) tore the
    agent down, unlinking the semaphores it had passed to a rank not yet started; that rank's
    start failed with a FileNotFoundError traceback printed under the launcher's one line
    (5 of 6 tries). The forkserver's processes now exit quietly in that case only: any other
    start failure still prints its traceback."""
    proc = subprocess.run([sys.executable, "-c", FORKSERVER_ABANDONED], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1, 1]
    abandoned, other, _ = proc.stderr.split("--- started")
    assert "Traceback" not in abandoned and abandoned.strip() == "", abandoned
    assert "Traceback" in other and "ValueError" in other, other


SWALLOWED_BY_TORCH = """
import contextlib, importlib.abc, os, signal, sys
from partc.interrupts import held_interrupts

class CtrlCOnNumpy(importlib.abc.MetaPathFinder):
    # a Ctrl-C arriving while torch's C extension imports numpy, made exact
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCOnNumpy())
guard = held_interrupts() if sys.argv[1] == "held" else contextlib.nullcontext()
try:
    with guard:
        import torch
    outcome = "imported"
except KeyboardInterrupt:
    outcome = "interrupted"
import torch
try:
    torch.ones(1).numpy()
    print(outcome, "numpy ok")
except RuntimeError:
    print(outcome, "numpy lost")
"""


@pytest.mark.parametrize("guard", ["bare", "held"])
def test_a_ctrl_c_while_torch_loads_interrupts_after_it_loaded(guard: str) -> None:
    """torch's C extension imports numpy as torch loads and carries on without it when that import
    fails: a Ctrl-C in that window was lost (`partc launch` trained on to its last step: 2 of 6
    launches interrupted 1.0 s after their start here). The bare import shows it (the test fails
    should torch stop swallowing it); around the imports of launch and of every command loading
    torch, partc.interrupts.held_interrupts holds the signal until the imports end and then
    interrupts, torch whole."""
    proc = subprocess.run([sys.executable, "-c", SWALLOWED_BY_TORCH, guard], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    if guard == "held":
        assert last == "interrupted numpy ok", proc.stdout
    else:
        assert last.startswith("imported"), proc.stdout


CTRL_C_AS_THE_CLI_LOADS = """
import importlib.abc, os, signal, sys

class CtrlCOnTheCli(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "partc.cli.main":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, CtrlCOnTheCli())
sys.argv = ["partc", "--version"]
from partc.cli.entry import main
main()
"""


def test_a_ctrl_c_while_the_cli_loads_is_one_line() -> None:
    """The console script's entry (partc.cli.entry) imports the CLI inside main: a Ctrl-C in its
    first 0.1-0.3 s printed a KeyboardInterrupt traceback from the script's import line (6 of 6
    tries at 0.2 s); now one line and exit 130. (The interpreter's own start, about 50 ms here,
    is before any partc code.)"""
    proc = subprocess.run([sys.executable, "-c", CTRL_C_AS_THE_CLI_LOADS], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "partc: interrupted\n" and proc.stdout == ""


def _ctrl_c_pending() -> None:
    """preexec_fn: a Ctrl-C that arrived while the CLI re-executed itself (blocked, pending)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("held", [True, False])
def test_a_ctrl_c_while_the_cli_re_executes_itself_is_taken_after_the_exec(held: bool) -> None:
    """The CLI re-executes itself (seeded str hashing) with SIGINT and SIGTERM blocked and
    PARTC_SIGNALS_HELD set, so a Ctrl-C while the second interpreter starts stays pending instead
    of ending it in Python's start-up traceback (1 of 6 at 0.1 s here); partc.cli.entry lets it
    in, one line and exit 130. Without the variable the mask is the caller's and is left alone."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PARTC_SIGNALS_HELD", None)
    if held:
        env["PARTC_SIGNALS_HELD"] = "1"
    proc = subprocess.run([PARTC, "--version"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=60, preexec_fn=_ctrl_c_pending)
    if held:
        assert (proc.returncode, proc.stderr, proc.stdout) == (130, "partc: interrupted\n", "")
    else:
        assert proc.returncode == 0 and proc.stdout.startswith("partc, version"), proc.stderr


MAIN_RELEASES = """
import os, signal, sys
os.environ["PARTC_SIGNALS_HELD"] = "1"
os.environ["PYTHONHASHSEED"] = "0"
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
sys.argv = ["partc", "--version"]
from partc.cli.main import main
try:
    main()
except SystemExit:
    pass
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
print(signal.SIGINT in blocked, signal.SIGTERM in blocked, "PARTC_SIGNALS_HELD" in os.environ)
"""


def test_the_clis_main_lets_in_what_the_re_exec_held_without_the_entry() -> None:
    """`python -m cli.main` (or any caller of partc.cli.main.main) enters without the console
    script's entry: main itself unblocks what the re-exec held, or Ctrl-C would stay blocked
    for the whole command."""
    proc = subprocess.run([sys.executable, "-c", MAIN_RELEASES], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False False False", proc.stdout


HELD_SIGTERM = """
import os, signal, sys, time
from partc.interrupts import held_interrupts

class Terminated(Exception):
    pass

def terminated(signum, frame):
    raise Terminated

signal.signal(signal.SIGTERM, terminated)
events = []
try:
    with held_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        events.append("block ran to its end")
        if sys.argv[1] == "twice":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            events.append("not reached")
except (Terminated, KeyboardInterrupt) as exc:
    events.append(type(exc).__name__)
print(events, signal.getsignal(signal.SIGTERM) is terminated,
      signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


@pytest.mark.parametrize("times", ["once", "twice"])
def test_held_signals_act_when_the_block_ends_or_at_once_when_sent_again(times: str) -> None:
    proc = subprocess.run([sys.executable, "-c", HELD_SIGTERM, times], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = (["block ran to its end", "Terminated"] if times == "once" else
                ["block ran to its end", "KeyboardInterrupt"])
    assert proc.stdout.strip() == f"{expected} True True", proc.stdout


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The processes of `pids` still alive after waiting up to `seconds` for them to end."""
    end = time.monotonic() + seconds
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < end:
        time.sleep(0.1)
    return alive


def test_launch_killed_by_sigkill_leaves_no_worker_training(mlp_plan: Path,
                                                            tmp_path: Path) -> None:
    """A launcher killed by SIGKILL (the OOM killer, `kill -9`, a job's hard timeout) cannot
    stop its workers; they see their parent gone and end themselves (end_with_parent) instead
    of training on, unaccounted for, to their last step."""
    watched = Watched(["launch", str(mlp_plan), "--steps", "100000", "--log-every", "1"],
                      new_session=True)
    watched.wait_for(r"^step 3/", timeout=180)  # training
    workers = list(launched_ranks(watched.proc.pid).values())
    assert len(workers) == 2, (workers, watched.text())
    watched.proc.kill()
    watched.finish(timeout=30)
    assert not _gone_within(workers, 15), watched.text()


def test_busy_neighbours_end_with_a_parent_killed_by_sigkill() -> None:
    """Busy neighbours loop until their parent kills them (partc.cost.neighbours); a compile
    killed by SIGKILL cannot, and they end themselves rather than compute on forever."""
    code = ("import time\nfrom partc.cost.neighbours import busy_neighbours\n"
            "with busy_neighbours(2):\n    print('busy', flush=True)\n    time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "busy"
        neighbours = [pid for _, pid in named_descendants(proc.pid, "partc-neighbour")]
        assert len(neighbours) == 2, neighbours
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not _gone_within(neighbours, 15)


def test_launch_failure_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    model = TEST_MODELS / "fails_on_rank.py"
    plan_dir = tmp_path / "plan"
    proc = run("compile", str(model), "-b", "8", "--cluster", "cpu-4", "--costs", "analytic",
               "--stages", "2", "--replicas", "1", "--microbatches", "2", "-o", str(plan_dir))
    assert proc.returncode == 0, _context(proc)
    plan = yaml.safe_load((plan_dir / "plan.yaml").read_text())
    last = plan["stages"][-1]
    failing = last["devices"][0]  # rank g runs device g; the loss runs on the last stage
    assert failing != 0  # the rank torch's whole-second timestamps used to blame
    watched = Watched(["launch", str(plan_dir), "--steps", "5"],
                      env={"PARTC_TEST_FAIL_RANK": str(failing), "PARTC_TEST_FAIL_AFTER": "3"})
    proc = watched.finish(timeout=240)
    context = _context(proc)
    assert proc.returncode == 1, context
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("partc: error:")]
    assert len(errors) == 1, context
    # the rank and its own error (not a peer's closed connection, nor the teardown's SIGTERM)
    assert f"rank {failing} failed" in errors[0], context
    assert f"RuntimeError: injected failure on rank {failing}" in errors[0], context


def test_the_first_failure_is_the_earliest_error_not_the_lowest_rank(tmp_path: Path) -> None:
    """torch's error files as the agent reads them (real files, torch's ProcessFailure): two
    ranks recorded an error within the same second, a third was killed by the teardown."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from partc.run.launch import failure_reason, root_failure

    second = int(time.time())

    def error_file(name: str, message: str, after_ns: int) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback ...\n{message}", "timestamp": str(second)}}}))
        os.utime(path, ns=(second * 10**9 + after_ns,) * 2)
        return str(path)

    collateral = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=error_file(
        "0.json", "RuntimeError: Connection closed by peer [127.0.0.1]:1234", 700_000_000))
    cause = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=error_file(
        "1.json", "RuntimeError: injected failure on rank 1", 200_000_000))
    torn_down = ProcessFailure(local_rank=2, pid=102, exitcode=-signal.SIGTERM,
                               error_file=str(tmp_path / "none.json"))
    failures = {0: collateral, 1: cause, 2: torn_down}
    assert ChildFailedError("w", failures).get_first_failure()[0] == 0  # whole seconds: a tie
    assert root_failure(failures) == (1, cause)
    assert failure_reason(cause) == "RuntimeError: injected failure on rank 1"
    # a rank that recorded its error and was then killed by the teardown while exiting
    killed_late = ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGTERM,
                                 error_file=cause.error_file)
    assert root_failure({0: collateral, 1: killed_late, 2: torn_down}) == (1, killed_late)
    assert failure_reason(killed_late) == "RuntimeError: injected failure on rank 1"
    # only signals: the one the agent saw first; a crash's signal is its reason
    crashed = ProcessFailure(local_rank=3, pid=103, exitcode=-signal.SIGSEGV,
                             error_file=str(tmp_path / "none.json"))
    assert root_failure({2: torn_down, 3: crashed})[0] == 3
    assert failure_reason(crashed) == "killed by SIGSEGV"
    assert failure_reason(torn_down) == "killed by SIGTERM"
