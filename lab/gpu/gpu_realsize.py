"""Real-size chain on one GPU in one call: make -> digest -> parity -> serve, each step under its own budget.

    python -m lab.gpu.gpu_realsize --out $OUT [--preset kl-48b-8l] [--dir /tmp/k3v-realsize]

Each step is a `k3verify` command in a child process with a timeout; a thread samples the GPU's used memory
(nvidia-smi, every 0.5 s) so each step's peak is known. The serve step starts `k3verify serve` on the parity report,
waits for /health, sends one /v1/completions request and stops the server. Prints a table and writes
$OUT/realsize.json. Budgets (seconds) can be changed with MAKE_S, DIGEST_S, PARITY_S, SERVE_S. REUSE=1 keeps a
checkpoint an earlier call on the same (warm) machine made; PARITY_ARGS adds words to the parity command; PARTS=N runs
the gate in N parts (consecutive check ids, each its own process), kept across calls on a warm machine, then merged
with `parity --merge` into the report `serve` reads; PARTS_PER_CALL=K stops after K parts run in this call, so a call
ends between parts rather than inside one; PARTS_FIRST="4 1" runs those parts first. Each finished part's report.json
and report-index.jsonl go into $OUT/parts.tgz as soon as it ends; unpacked into .realsize-parts/ at the repository
root (carry it), a later call on a fresh machine takes the parts that ran on the same package source and card instead
of running them again (the merge checks the rest). Every step's output is written to $OUT/logs/<step>.log as it runs,
so a call cut off by its time limit still says how far it got. Consecutive ids keep the checks that share cached
models together: a split balanced by an earlier run's per-check times was tried and is slower (served.vs_transformers
took 243 s in a part without served.vs_gold, 7 s after it, as it builds the served model and the gold itself).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

K3V = [sys.executable, "-m", "k3verify"]
RESULT_WORDS = {"PASS", "FAIL", "ERROR", "SKIPPED", "EXCUSED", "VACUOUS"}
CARRIED_PARTS = Path(".realsize-parts")  # parts that earlier calls returned in parts.tgz, unpacked and carried
PART_FILES = ("report.json", "report-index.jsonl")  # what `parity --merge` reads of a part
LOG_DIR = Path("/tmp/k3v-gpu/logs")  # main() puts it under --out


@dataclass
class Step:
    name: str
    budget_s: float
    wall_s: float = 0.0
    exit: int | None = None
    peak_gpu_mib: float | None = None
    tail: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class GpuSampler(threading.Thread):
    """(time, MiB used) every 0.5 s from nvidia-smi, for the whole device."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=5).stdout
                self.samples.append((time.monotonic(), float(out.strip().splitlines()[0])))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self.stopped.wait(0.5)

    def peak(self, start: float, end: float) -> float | None:
        inside = [mib for t, mib in self.samples if start <= t <= end]
        return max(inside) if inside else None


def run_step(step: Step, argv: list[str], sampler: GpuSampler) -> None:
    print(f"== {step.name} (budget {step.budget_s:.0f} s): {' '.join(argv[2:])}", flush=True)
    start = time.monotonic()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{step.name.replace(' ', '-').replace('/', '-of-')}.log"
    with log.open("w") as sink:  # written as it runs: a call cut off by its limit still returns it
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, text=True)
        try:
            step.exit = proc.wait(timeout=step.budget_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            step.exit = 124
    output = log.read_text(errors="replace")
    step.wall_s = time.monotonic() - start
    step.peak_gpu_mib = sampler.peak(start, time.monotonic())
    if step.exit is not None and step.exit < 0:  # the kernel's out-of-memory killer sends SIGKILL without a word
        output += f"\n{step.name}: killed by signal {-step.exit} ({signal.Signals(-step.exit).name})"
    lines = [ln for ln in output.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
    step.tail = lines[-25:]
    results = [ln for ln in lines[:-25] if ln.split(" ", 1)[0] in RESULT_WORDS]  # --verbose: every check's line
    print("\n".join(results + step.tail), flush=True)


def serve_step(step: Step, ckpt: Path, report_dir: Path, sampler: GpuSampler, port: int, device: str) -> None:
    import httpx

    print(f"== {step.name} (budget {step.budget_s:.0f} s)", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen([*K3V, "serve", "--checkpoint", str(ckpt), "--device", device, "--report-dir",
                             str(report_dir), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while time.monotonic() - start < step.budget_s:
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    step.detail["ready_s"] = time.monotonic() - start
                    body = {"model": ckpt.name, "prompt": "The capital of France is", "max_tokens": 16,
                            "temperature": 0}
                    t0 = time.monotonic()
                    r = httpx.post(f"{url}/v1/completions", json=body,
                                   timeout=max(5.0, step.budget_s - (t0 - start)))
                    step.detail |= {"status": r.status_code, "request_s": time.monotonic() - t0}
                    if r.status_code == 200:
                        data = r.json()
                        step.detail |= {"text": data["choices"][0]["text"], "usage": data["usage"]}
                    step.exit = 0 if r.status_code == 200 else 1
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            step.exit = 124
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if step.exit is None:
            step.exit = proc.returncode if proc.returncode else 1
        step.wall_s = time.monotonic() - start
        step.peak_gpu_mib = sampler.peak(start, time.monotonic())
        step.tail = [ln for ln in (out or "").splitlines() if ln.strip()][-15:]
        print("\n".join(step.tail), f"\nrequest: {step.detail}", flush=True)


def gate_ids() -> list[str]:
    from k3verify.gates.core.suite import gate_checks, load_all_checks

    return sorted(c.id for c in gate_checks(load_all_checks(), "quick"))


@functools.cache
def current_run() -> dict[str, str | None]:
    """What a part must share with this call to be merged with its parts: k3verify's source and the card (the run
    record a report of this call would hold; computed once). The commit may differ (`parity --merge` keeps each
    part's): an edit outside the package does not make a part run again."""
    import torch

    from k3verify.gates.core.suite import collect_run_info

    info = collect_run_info(device="cuda" if torch.cuda.is_available() else "cpu", seed=0, suite="quick")
    return {"source_digest": info.source_digest, "device_name": info.device_name}


def take_carried(carried: Path, part: Path) -> None:
    """Copy a part an earlier call returned (carried in the tree) to where this call's parts live, when this machine
    has none and it ran on this package source and card; otherwise say why it is not taken."""
    if (part / "report.json").is_file() or not (carried / "report.json").is_file():
        return
    run = json.loads((carried / "report.json").read_text())["run"]
    differ = [f"{k} {run.get(k)!r} (this call: {v!r})" for k, v in current_run().items() if run.get(k) != v]
    if differ:
        print(f"== {carried}: not taken, it ran with {'; '.join(differ)}", flush=True)
        return
    part.mkdir(parents=True, exist_ok=True)
    for name in PART_FILES:
        shutil.copy2(carried / name, part / name)
    print(f"== {part.name}: taken from {carried} (an earlier call's)", flush=True)


def bundle_parts(parts_dir: Path, bundle: Path) -> None:
    """Every finished part's report and index in one archive (a call returns few files), unpacked under
    CARRIED_PARTS by the one who carries them to the next call."""
    tmp = bundle.with_suffix(".partial")
    with tarfile.open(tmp, "w:gz") as tar:
        for part in sorted(parts_dir.glob("part-*")):
            for name in PART_FILES:
                if (part / name).is_file():
                    tar.add(part / name, arcname=f"{parts_dir.name}/{part.name}/{name}")
    tmp.replace(bundle)


def run_parts(step: Step, parity: list[str], parts: int, parts_dir: Path, report: Path, sampler: GpuSampler) -> None:
    """The gate in `parts` runs of consecutive check ids (each its own process: an empty card), then merged into
    `report`. A part whose
    report a call before this one on the same machine finished is kept, so a later call resumes where the budget
    ran out."""
    ids = gate_ids()
    per_call = int(os.environ.get("PARTS_PER_CALL", str(parts)))
    start, ran = time.monotonic(), 0
    dirs = [parts_dir / f"part-{k + 1}-of-{parts}" for k in range(parts)]
    first = [int(w) - 1 for w in os.environ.get("PARTS_FIRST", "").split()]  # e.g. "4": part 4 before the others
    for k in first + [k for k in range(parts) if k not in first]:
        chosen = ids[k * len(ids) // parts:(k + 1) * len(ids) // parts]
        part = dirs[k]
        take_carried(CARRIED_PARTS / parts_dir.name / part.name, part)
        done = part / "report.json"
        if done.is_file() and json.loads(done.read_text())["summary"]["verdict"] in ("pass", "inconclusive"):
            print(f"== part {k + 1}/{parts}: done before ({len(chosen)} checks)", flush=True)
            continue
        if ran == per_call:
            step.exit, step.wall_s = 3, time.monotonic() - start
            print(f"== part {k + 1}/{parts}: left for the next call (PARTS_PER_CALL={per_call})", flush=True)
            return
        ran += 1
        left = step.budget_s - (time.monotonic() - start)
        sub = Step(f"part {k + 1}/{parts}", left)
        run_step(sub, [*parity, *[w for i in chosen for w in ("--only", i)], "--report-dir", str(part)], sampler)
        step.detail[sub.name] = {"exit": sub.exit, "wall_s": sub.wall_s, "peak_gpu_mib": sub.peak_gpu_mib}
        bundle_parts(parts_dir, LOG_DIR.parent / "parts.tgz")
        if sub.exit not in (0, 4):
            step.exit, step.wall_s = sub.exit, time.monotonic() - start
            return
    merge = Step("merge", 60)
    run_step(merge, [*K3V, "parity", "--merge", *map(str, dirs), "--report-dir", str(report)], sampler)
    step.exit, step.wall_s, step.tail = merge.exit, time.monotonic() - start, merge.tail
    step.peak_gpu_mib = sampler.peak(start - 1, time.monotonic())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/k3v-gpu")))
    parser.add_argument("--preset", default="kl-48b-8l")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/k3v-realsize"))
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--device", default="cuda", help="cpu runs the same chain on a small preset (a dry run)")
    args = parser.parse_args()
    global LOG_DIR
    LOG_DIR = args.out / "logs"
    budget = {k: float(os.environ.get(f"{k.upper()}_S", v)) for k, v in
              (("make", 100), ("digest", 40), ("parity", 340), ("serve", 150))}
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt, report = args.dir / args.preset, args.out / "realsize-parity"
    sampler = GpuSampler()
    sampler.start()
    steps = [Step("make", budget["make"]), Step("digest", budget["digest"]), Step("parity", budget["parity"]),
             Step("serve", budget["serve"])]
    if os.environ.get("REUSE") == "1" and (ckpt / "config.json").is_file():  # a warm machine's earlier make
        steps[0].exit, steps[0].tail = 0, [f"reused {ckpt}"]
    else:
        run_step(steps[0], [*K3V, "checkpoint", "make", "--preset", args.preset, "--device", args.device, "--force",
                            str(ckpt)], sampler)
    if steps[0].exit == 0:
        run_step(steps[1], [*K3V, "checkpoint", "inspect", str(ckpt)], sampler)
        parity = [*K3V, "parity", "--checkpoint", str(ckpt), "--device", args.device, "--verbose",
                  *os.environ.get("PARITY_ARGS", "").split()]
        parts = int(os.environ.get("PARTS", "1"))
        if parts > 1:
            run_parts(steps[2], parity, parts, args.dir / f"{args.preset}-parts", report, sampler)
        else:
            run_step(steps[2], [*parity, "--report-dir", str(report)], sampler)
        if steps[2].exit == 0:
            serve_step(steps[3], ckpt, report, sampler, args.port, args.device)
    sampler.stopped.set()
    size = sum(f.stat().st_size for f in ckpt.iterdir()) / 1e9 if ckpt.is_dir() else None
    print(f"\n{'step':<8} {'budget s':>9} {'wall s':>8} {'exit':>5} {'peak GPU GiB':>13}")
    for s in steps:
        peak = "-" if s.peak_gpu_mib is None else f"{s.peak_gpu_mib / 1024:.1f}"
        print(f"{s.name:<8} {s.budget_s:>9.0f} {s.wall_s:>8.1f} {s.exit if s.exit is not None else '-':>5} {peak:>13}")
    print(f"checkpoint {ckpt}: {size if size is None else round(size, 2)} GB on disk")
    (args.out / "realsize.json").write_text(json.dumps({"preset": args.preset, "checkpoint_gb": size,
                                                        "steps": [asdict(s) for s in steps]}, indent=2))
    return 0 if all(s.exit == 0 for s in steps) else 1


if __name__ == "__main__":
    raise SystemExit(main())
