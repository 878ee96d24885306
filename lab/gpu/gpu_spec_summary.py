"""The `gpu_session.sh spec` table: the bench's parity rows (kl-48b-8l), the spec.* CUDA checks (k3-syn-25) and
the gpu test, one line each; then the README table of the speeds. Writes $OUT/spec-summary.json.

    python -m lab.gpu.gpu_spec_summary OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any


def _num(x: Any) -> str:
    return "-" if x is None else f"{float(x):.3g}"


def bench_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "spec.json"
    if not path.is_file():
        return [{"row": "bench kl-48b-8l", "status": "missing", "metric": None, "control": "no spec.json (timed out?)"}]
    data = json.loads(path.read_text())
    rows = [{"row": p["id"], "status": p["status"], "metric": p["metric"], "control": _num(p["control_metric"])}
            for p in data["parity"]]
    rows.append({"row": "bench speeds", "status": "reported" if data["speeds_reported"] else "withheld",
                 "metric": None, "control": f"KDA score path: {data['kda_verify_path']}"})
    refs = [r for r in data["speed"] if "ref_converged" in r]
    if refs:  # a row whose reference did not converge does not measure its nominal acceptance
        ok = sum(bool(r["ref_converged"]) for r in refs)
        rows.append({"row": "bench controlled-drafter references", "status": "pass" if ok == len(refs) else "fail",
                     "metric": max(r["ref_iterations"] for r in refs),
                     "control": f"{ok}/{len(refs)} rows converged (metric: most untimed runs)"})
    return rows


def check_rows(out: Path) -> list[dict[str, Any]]:
    path = out / "parity-spec" / "report.json"
    if not path.is_file():
        return [{"row": "spec.* cuda (k3-syn-25)", "status": "missing", "metric": None,
                 "control": "no report.json (timed out?): see parity-spec.log"}]
    results = json.loads(path.read_text())["results"]
    caught = {"fail": "caught", "pass": "NOT caught"}  # a control must fail
    return [{"row": f"{r['id']} (k3-syn-25)", "status": r["status"], "metric": r["metric"],
             "control": caught.get((r.get("control") or {}).get("status", "-"), "-")} for r in results]


def test_rows(out: Path) -> list[dict[str, Any]]:
    log = out / "spec-pytest.log"
    text = log.read_text() if log.is_file() else ""
    found = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED)\S* (\S+)", text, flags=re.M)
    if not found:
        return [{"row": "gpu test", "status": "missing", "metric": None, "control": "see spec-pytest.log"}]
    return [{"row": name.split("::")[-1], "status": status.lower(), "metric": None, "control": "-"}
            for status, name in found]


def main(out: Path) -> int:
    rows = bench_rows(out) + check_rows(out) + test_rows(out)
    print(f"{'row':44} {'status':9} {'metric':>10}  control")
    for r in rows:
        print(f"{r['row']:44} {r['status']:9} {_num(r['metric']):>10}  {r['control']}")
    (out / "spec-summary.json").write_text(json.dumps(rows, indent=1))
    if (out / "spec.json").is_file():
        from k3verify.bench.spec import markdown_table

        print()
        print(markdown_table(json.loads((out / "spec.json").read_text())))
    green = all(r["status"] in ("pass", "passed", "reported") for r in rows)
    print(f"\nspec: {'GREEN' if green else 'NOT green'}")
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
