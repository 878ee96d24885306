"""`k3verify serve`'s supervisor: the process above the engine's process and the HTTP front end's.

Why: the front end and the engine run in processes of their own (api/engine_link.py says why), and either can
die (kill -9, the OOM killer, a crash in native code). The supervisor binds the listening socket once and keeps
it, starts the engine's process (which reads the checkpoint, checks it against the gate report and builds the
engine), then the front end, and restarts whichever dies. A restarted engine process reads and checks the
checkpoint again; if the directory no longer matches a passing report it refuses, and the supervisor stops with
that reason. A restarted front end takes the same listening socket (connections that arrive meanwhile wait in its
backlog) and the tokenizer bytes from the engine again. Restarts are bounded per process (`max_restarts` within
`window_s`): past that the supervisor stops both and exits non-zero, naming what kept dying.

Children run in sessions of their own (a terminal's Ctrl-C reaches the supervisor only, which stops the front end
first, then the engine) and watch their control connection: when the supervisor is gone, they stop too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from k3verify.api.engine_link import PACKAGE_ROOT

CHILD_MAIN = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib; "
              "m = importlib.import_module(sys.argv[2]); sys.exit(getattr(m, sys.argv[3])(*map(int, sys.argv[4:])))")
START_TIMEOUT_S = 600.0  # a real-size engine reads and hashes its checkpoint, then loads it
STOP_GRACE_S = 10.0


class ChildError(RuntimeError):
    """A child refused to start (code 2: what it would serve is not vouched for) or failed to (code 1)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass
class Child:
    """One supervised process: `module.function(control_fd, *pass_fds)` run with this package, told `payload` and
    the number of times it was restarted so far first; it answers ("ready", pid), ("refused", why) or ("failed",
    why)."""

    name: str
    module: str
    function: str
    payload: tuple[Any, ...]
    pass_fds: tuple[int, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    control: Connection | None = None
    started: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        ours, theirs = socket.socketpair()
        fds = (theirs.fileno(), *self.pass_fds)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD_MAIN, PACKAGE_ROOT, self.module, self.function,
                                          *map(str, fds)], pass_fds=fds, start_new_session=True)
        finally:
            theirs.close()
        self.control = Connection(os.dup(ours.fileno()))
        ours.close()
        self.started += 1
        self.control.send((*self.payload, self.started - 1))  # the payload, then how often it was restarted
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None and self.control is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.control.poll(0.1):
                try:
                    kind, detail = self.control.recv()
                except (EOFError, OSError):
                    break
                if kind == "ready":
                    return
                self.stop()
                raise ChildError(2 if kind == "refused" else 1, str(detail))
            if self.proc.poll() is not None:
                break
        self.stop()
        rc = self.proc.poll()
        raise ChildError(1, f"the {self.name} process " + (f"ended ({describe_exit(rc)}) before it was ready"
                                                            if rc is not None else f"was not ready in {timeout:g} s"))

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Ask it to stop (its control connection), then SIGTERM, then SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None and self.control is not None:
            try:
                self.control.send(("stop",))
            except (OSError, ValueError):
                pass
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and self.proc.poll() is None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(grace)
                break
            except subprocess.TimeoutExpired:
                continue
        if self.control is not None:
            self.control.close()
            self.control = None


@dataclass
class RestartBudget:
    """At most `max_restarts` restarts of one process within `window_s`."""

    max_restarts: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    times: deque[float] = field(default_factory=deque)

    def allow(self) -> bool:
        now = self.clock()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class Supervisor:
    """Run `engine` and `front` (started in that order), restart either when it dies, until interrupted."""

    def __init__(self, engine: Child, front: Child, max_restarts: int, window_s: float,
                 say: Callable[[str], None] = print) -> None:
        self.engine, self.front, self.say = engine, front, say
        self.budgets = {c.name: RestartBudget(max_restarts, window_s) for c in (engine, front)}
        self.max_restarts, self.window_s = max_restarts, window_s

    def start(self) -> None:
        """Both children, ready; ChildError (the front end stopped again) if either refuses or fails."""
        self.engine.start()
        try:
            self.front.start()
        except ChildError:
            self.engine.stop()
            raise

    def run(self) -> int:
        """Watch both until SIGINT / SIGTERM (exit 0), a refusal on restart (2) or too many restarts (1)."""
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                children = [c for c in (self.engine, self.front) if c.control is not None]
                for conn in wait([c.control for c in children if c.control is not None], timeout=1.0):
                    child = next(c for c in children if c.control is conn)
                    if not self._alive(child):
                        code = self._restart(child)
                        if code is not None:
                            return code
        except KeyboardInterrupt:
            return 0
        finally:
            self.front.stop()
            self.engine.stop()

    def _alive(self, child: Child) -> bool:
        """Readable control: a message (logged) or EOF, i.e. the process is gone."""
        assert child.control is not None
        try:
            msg = child.control.recv()
        except (EOFError, OSError):
            return False
        self.say(f"k3verify serve: the {child.name} process says {msg!r}")
        return True

    def _restart(self, child: Child) -> int | None:
        """Start `child` again; an exit code for the supervisor when it must stop instead."""
        assert child.proc is not None
        code = child.proc.wait()
        if child.control is not None:
            child.control.close()
            child.control = None
        while True:
            if not self.budgets[child.name].allow():
                self.say(f"k3verify serve: the {child.name} process (pid {child.pid}) ended ({describe_exit(code)}); "
                         f"it was restarted {self.max_restarts} time(s) within {self.window_s:g} s already: giving up")
                return 1
            self.say(f"k3verify serve: the {child.name} process (pid {child.pid}) ended ({describe_exit(code)}); "
                     "restarting it")
            try:
                child.start()
            except ChildError as exc:
                if exc.code == 2:
                    self.say(f"k3verify serve: the restarted {child.name} process refused: {exc}")
                    return 2
                self.say(f"k3verify serve: the {child.name} process did not come back: {exc}")
                code = child.proc.returncode if child.proc.returncode is not None else 1
                continue
            self.say(f"k3verify serve: the {child.name} process is back (pid {child.pid})")
            return None
