"""`partc ARGS...` in its own process, forked from a server that imported partc and torch once.

Most CLI tests need a process per invocation (its exit status, its stdout and stderr, its files,
nothing shared with pytest) but not a fresh interpreter: each `partc` exec imports torch,
torch.export and partc again, 2-3.5 s of CPU, about a third of the default suite's time when
every CLI test paid it. `run_partc` forks the command from a server (one per pytest process,
this file run as a script) that imported what any `partc` command imports and nothing else ran
in; the child takes the call's working directory, environment and argv, writes to its own stdout
and stderr files, and runs the console script's `main` to the interpreter's normal exit (atexit
handlers, flushes, a traceback and status 1 for an uncaught exception), as the script would.

Tests about the installed script, interpreter start-up, imports, signals to a process group, or
an environment read when torch loads (`OMP_NUM_THREADS`) run the real `partc` executable
(tests/test_cli.py, tests/test_packaging.py, tests/test_bad_inputs_signals.py,
tests/test_architecture.py), as does any call with a command `prefix` (setpriv) or `exec_=True`.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import IO, Callable, Mapping, NoReturn, Sequence

from partc.cli.main import HASH_SEED

BIN = Path(sys.executable).parent
PARTC = str(BIN / "partc")
ROOT = Path(__file__).resolve().parent.parent

# What every `partc` command imports (compile's capture, pricing and emit; check; the CLI), and
# the top of transformers, which most test models import (its parts load lazily, in the child): a
# command needing more imports it in the child, as the console script would.
PRELOAD = ("torch", "torch.export", "partc.cli.main", "partc.emit.compile", "partc.emit.check",
           "partc.frontend.capture", "transformers")
# Variables torch or its OpenMP runtime read once, when they load: the server's values would hold
# in the child whatever the call asks, so a call changing one runs the real executable.
_READ_AT_IMPORT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "PYTHONPATH",
                   "PYTHONWARNINGS", "PYTHONHASHSEED")
# The console script re-executes itself unless str hashing is seeded with partc's seed: the
# server starts seeded, and so does every child (the environment the script's re-exec gives).
_SEEDED = {"PYTHONHASHSEED": HASH_SEED}


class _Server:
    """The fork server of this process: a line of JSON in (a command), the child's pid and then
    its wait status out."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            cwd=ROOT, env={**os.environ, **_SEEDED}, bufsize=0)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.requests: IO[bytes] = self.process.stdin
        self.replies = self.process.stdout.fileno()
        # read from the pipe itself: the pid and the status of a quick command can arrive
        # together, and a buffered reader would keep the second where select cannot see it
        self.pending = b""

    def reply(self, timeout: float | None) -> str | None:
        """The next line the server wrote; None when none came within `timeout` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self.replies], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.replies, 4096)
            if not chunk:
                raise RuntimeError("the partc fork server ended (see pytest's stderr)")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip()


_server: _Server | None = None


def _exec_partc(args: Sequence[str], cwd: Path, env: Mapping[str, str] | None,
                prefix: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, PARTC, *args], capture_output=True, text=True, cwd=cwd,
                          env=None if env is None else dict(env), timeout=timeout)


def run_partc(*args: str, cwd: Path | str = ROOT, env: Mapping[str, str] | None = None,
              prefix: Sequence[str] = (), timeout: float = 300,
              exec_: bool = False) -> subprocess.CompletedProcess[str]:
    """`partc ARGS...` as its own process, from `cwd` (the repository root by default), with
    `env` (this process's environment by default); returns what subprocess.run would (text
    output), and raises subprocess.TimeoutExpired after `timeout` seconds (the child killed)."""
    global _server
    environment = {**_SEEDED, **(os.environ if env is None else env)}
    server_env = {**os.environ, **_SEEDED}
    if exec_ or prefix or any(environment.get(k) != server_env.get(k) for k in _READ_AT_IMPORT):
        return _exec_partc(args, Path(cwd), env, prefix, timeout)
    if _server is None or _server.process.poll() is not None:
        _server = _Server()
    command = [PARTC, *args]
    with _server.lock, tempfile.TemporaryDirectory(prefix="partc-cli-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"argv": command, "cwd": str(cwd), "env": environment, "stdout": str(out),
                   "stderr": str(err)}
        _server.requests.write((json.dumps(request) + "\n").encode())
        pid = int(_server.reply(None) or 0)
        status = _server.reply(timeout)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            _server.reply(None)
            raise subprocess.TimeoutExpired(command, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(command, int(status), _read(out), _read(err))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _serve() -> dict[str, object] | None:
    """The server's loop: fork a child per request and report its pid and exit code; returns
    (in the child only) the request the child is to run."""
    for name in PRELOAD:
        __import__(name)
    requests, replies = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return dict(request)
        replies.write(f"{pid}\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
        replies.flush()
    return None


def _become(request: dict[str, object]) -> None:
    """In the forked child: take the request's streams, directory, environment and argv."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        target = os.open(str(request[key]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(str(request["cwd"]))
    os.environ.clear()
    os.environ.update(dict(request["env"]))  # type: ignore[call-overload]
    sys.argv = list(request["argv"])  # type: ignore[call-overload]
    # The console script is the program's main module: a forkserver partc starts (launch's,
    # calibrate's) imports the main module's file, which must be the script's, not this one.
    script = types.ModuleType("__main__")
    script.__file__ = PARTC
    sys.modules["__main__"] = script


def _exit_as_the_script_would(main: Callable[[], object]) -> NoReturn:
    """Run `main` and end this process as the interpreter would after it (the exit status of a
    SystemExit, a traceback and 1 for an uncaught exception, threads joined, atexit handlers
    run, streams flushed), but without tearing down the modules: with torch loaded that
    takes 0.4-0.6 s, longer than a `partc launch` refusing a bad plan runs in all."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException as exc:  # what the interpreter prints for an uncaught exception
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:  # as CPython ends after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    # Neither this folder nor the server's directory is on a `partc` script's path.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    job = _serve()
    if job is None:
        sys.exit(0)
    _become(job)
    del job
    from partc.cli.entry import main

    _exit_as_the_script_would(main)
