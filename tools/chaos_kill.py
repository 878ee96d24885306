"""The kill -9 half of tools/chaos.py: a supervised `k3verify serve` in a child process, streaming clients, and
one process killed under them.

Engine killed: every client must get an answer (a stream's error event, or a 503 with Retry-After), never a
connection closed without one; the supervisor restarts the engine, which serves again. HTTP front end killed: its
own connections die with it (the kernel closes them), but the engine's process lives on (same pid), the front end
is back within 10 s on the same port, requests sent while it was down wait in the listening socket's backlog and
are answered, and the engine frees what the dead front end's clients held.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

BACK_WITHIN_S = 10.0
PIDS = re.compile(r"in its own process \(pid (\d+)\) beside the engine's \(pid (\d+)\)")
BACK = re.compile(r"the (engine|HTTP front end) process is back \(pid (\d+)\)")


class ServeProcess:
    """`k3verify serve ARGV` in a child process; its log gives the pids of its engine and its front end."""

    def __init__(self, *argv: str, port: int) -> None:
        code = "from k3verify.cli import main; raise SystemExit(main())"
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-c", code, "serve", *argv, "--port", str(port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.pids: dict[str, int] = {}
        self.back_at: dict[str, float] = {}  # monotonic time of each "process is back" line
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if m := PIDS.search(line):
                self.pids["HTTP front end"], self.pids["engine"] = int(m.group(1)), int(m.group(2))
            if m := BACK.search(line):
                self.pids[m.group(1)] = int(m.group(2))
                self.back_at[m.group(1)] = time.monotonic()

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until /health answers 200 (AssertionError naming the log if the server exits or never does)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200 and len(self.pids) == 2:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"serve was not healthy within {timeout} s: {self.log()}")

    def log(self) -> str:
        return "\n".join(self.lines[-30:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._reader.join(5)
        return int(self.proc.returncode)


@dataclass
class Answer:
    streamed: bool
    status: int | None = None
    final: bool = False  # a finish_reason, an error event, or an error body arrived
    error: str = ""
    retry_after: str | None = None
    cut: str = ""  # the connection ended without an answer: why


@dataclass
class KillResult:
    answers: list[Answer] = field(default_factory=list)
    back_after_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def unanswered(self) -> list[Answer]:
        return [a for a in self.answers if not a.final]


async def one_client(client: httpx.AsyncClient, model: str, i: int, started: asyncio.Event | None,
                     streamed: bool = True) -> Answer:
    """A completion of 64 tokens, answered or cut."""
    out = Answer(streamed=streamed)
    body: dict[str, Any] = {"model": model, "prompt": f"client {i} says", "max_tokens": 64, "ignore_eos": True,
                            "stream": out.streamed}
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            if started is not None:
                started.set()
            if not out.streamed or r.status_code != 200:
                data = (await r.aread()).decode()
                out.final = '"choices"' in data or '"error"' in data
                out.error = data[:200] if '"error"' in data else ""
                return out
            async for line in r.aiter_lines():
                if line.startswith("data: {") and ('"error"' in line or '"finish_reason":"' in line):
                    out.final, out.error = True, line[6:206] if '"error"' in line else ""
                    if out.error:
                        return out
    except httpx.HTTPError as exc:
        out.cut = f"{type(exc).__name__}: {exc}"
    return out


async def clients_under_kill(url: str, model: str, clients: int, kill_after_s: float, pid: int,
                             killed_at: list[float]) -> list[Answer]:
    """`clients` streaming requests and a quarter as many plain ones at once; `pid` gets SIGKILL `kill_after_s`
    after the first stream started (the time of the kill is appended to `killed_at`)."""
    plain = clients // 4
    limits = httpx.Limits(max_connections=clients + plain + 8, max_keepalive_connections=0)
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, limits=limits) as client:
        tasks = [asyncio.create_task(one_client(client, model, i, started if i < clients else None, i < clients))
                 for i in range(clients + plain)]
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.sleep(kill_after_s)
        os.kill(pid, 9)
        killed_at.append(time.monotonic())
        return list(await asyncio.gather(*tasks))


def kill_engine(server: ServeProcess, model: str, clients: int) -> KillResult:
    """kill -9 the engine's process under `clients` clients: each gets an answer; the engine comes back."""
    res = KillResult()
    pid = server.pids["engine"]
    killed_at: list[float] = []
    res.answers = asyncio.run(clients_under_kill(server.url, model, clients, 0.5, pid, killed_at))
    server.wait_healthy(120)
    res.back_after_s = server.back_at["engine"] - killed_at[0]
    errors = [a for a in res.answers if a.error]
    no_retry = [a for a in res.answers if a.status == 503 and a.retry_after is None]
    res.notes.append(f"engine kill -9 (pid {pid}) under {clients} streaming and {clients // 4} plain clients: "
                     f"{sum(a.final for a in res.answers)} "
                     f"answered ({sum(not a.error for a in res.answers if a.final)} complete, {len(errors)} errors: "
                     f"{sum(a.status == 503 for a in res.answers)} HTTP 503, "
                     f"{sum(a.streamed and a.status == 200 for a in errors)} stream error events), "
                     f"{len(res.unanswered)} closed without an answer; engine back (pid {server.pids['engine']}) "
                     f"{res.back_after_s:.1f} s after the kill")
    res.failures += [f"closed without an answer: {a}" for a in res.unanswered]
    res.failures += [f"503 without Retry-After: {a}" for a in no_retry]
    if server.pids["engine"] == pid:
        res.failures.append("the engine's pid did not change: it was not restarted")
    if not errors:
        res.failures.append("no client saw the engine die: the kill proved nothing")
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    counted = [line for line in httpx.get(f"{server.url}/metrics", timeout=5).text.splitlines()
               if line.startswith("k3v_engine_restarts_total ")]
    res.notes.append(f"after it: /health {health.get('status')} restarts {health.get('restarts')}; {counted}")
    if health.get("restarts", 0) < 1 or health.get("status") != "degraded":
        res.failures.append(f"/health does not count the engine's restart: {health}")
    if counted != ["k3v_engine_restarts_total 1.0"]:
        res.failures.append(f"k3v_engine_restarts_total does not count the engine's restart: {counted}")
    res.failures += _served_after(server, model)
    return res


def kill_front_end(server: ServeProcess, model: str, clients: int) -> KillResult:
    """kill -9 the HTTP front end under `clients` streams: the engine lives on, the front end is back within
    BACK_WITHIN_S, requests sent while it was down are answered, the dead clients' requests are freed."""
    res = KillResult()
    engine, front = server.pids["engine"], server.pids["HTTP front end"]
    killed_at: list[float] = []

    async def run() -> tuple[list[Answer], list[Answer]]:
        answers = await clients_under_kill(server.url, model, clients, 0.5, front, killed_at)
        async with httpx.AsyncClient(base_url=server.url) as client:  # sent while the front end is down
            late = await asyncio.gather(*(one_client(client, model, i, None, i % 2 == 0) for i in range(4)))
        return answers[:clients], list(late)

    cut, late = asyncio.run(run())
    server.wait_healthy(60)
    res.back_after_s = server.back_at["HTTP front end"] - killed_at[0]
    res.answers = late
    back = server.pids["HTTP front end"]
    try:
        os.kill(engine, 0)
        engine_alive = True
    except OSError:
        engine_alive = False
    freed = _engine_idle(server, 30)
    res.notes.append(f"front end kill -9 (pid {front}) under {clients} streams: {sum(bool(a.cut) for a in cut)} cut "
                     f"with it (its sockets), {sum(a.final for a in cut)} answered before; engine pid {engine} alive "
                     f"{engine_alive}; front end back (pid {back}) {res.back_after_s:.1f} s after the kill; "
                     f"{sum(a.final for a in late)} of {len(late)} requests sent while it was down answered; engine "
                     f"idle again {freed}")
    if not engine_alive or server.pids["engine"] != engine:
        res.failures.append(f"the engine's process (pid {engine}) did not survive the front end's death")
    if back == front:
        res.failures.append("the front end's pid did not change: it was not restarted")
    if res.back_after_s > BACK_WITHIN_S:
        res.failures.append(f"the front end was back {res.back_after_s:.1f} s after the kill (limit {BACK_WITHIN_S:g})")
    res.failures += [f"sent while the front end was down, not answered: {a}" for a in late if not a.final]
    res.failures += [f"sent while the front end was down, not 200: {a}" for a in late if a.status != 200]
    if not freed:
        res.failures.append("the engine still holds requests of the dead front end's clients after 30 s")
    res.failures += _served_after(server, model)
    return res


def _engine_idle(server: ServeProcess, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        if health.get("running") == 0 and health.get("waiting") == 0:
            return True
        time.sleep(0.2)
    return False


def _served_after(server: ServeProcess, model: str) -> list[str]:
    body = {"model": model, "prompt": "after", "max_tokens": 3}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    return [] if r.status_code == 200 else [f"a request after the restart got {r.status_code}: {r.text[:200]}"]
