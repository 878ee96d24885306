"""JUnit XML from a report dict: one testcase per check (and one per mutant when present), so any CI
that reads JUnit shows each gate. fail and vacuous are <failure>, error is <error>, skipped <skipped>."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from typing import Any

from k3verify.gates.core.excused import EXCUSED, status_label

# XML 1.0 forbids most control characters; a traceback can carry them.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(text: Any) -> str:
    return _INVALID_XML.sub("?", "" if text is None else str(text))


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _summary_line(result: Mapping[str, Any]) -> str:
    control = result.get("control") or {}
    label = status_label(result["status"], result["metrics"])
    parts = [f"status={result['status']}" + (f" ({label})" if result["status"] == EXCUSED else ""),
             f"kind={result['kind']}", f"metric={_fmt(result['metric'])}",
             f"bar={_fmt(result['bar'])}", f"margin={_fmt(result['margin'])}",
             f"control={control.get('status', 'none')}"]
    if result.get("worst"):
        w = result["worst"]
        parts.append(f"worst index={w['index']} ref={_fmt(w['reference'])} cand={_fmt(w['candidate'])}")
    return " ".join(parts)


def _check_suite(data: Mapping[str, Any]) -> ET.Element:
    run, results, counts = data["run"], data["results"], data["summary"]["counts"]
    suite = ET.Element("testsuite", {
        "name": f"k3verify.parity.{run['suite']}",
        "tests": str(len(results)),
        "failures": str(counts["fail"] + counts["vacuous"]),
        "errors": str(counts["error"]),
        "skipped": str(counts["skipped"]),
        "time": f"{run['wall_time_s']:.3f}",
        "timestamp": run["started_at"],
    })
    props = ET.SubElement(suite, "properties")
    for a in (run.get("endpoint") or {}).get("accepted_conventions") or []:  # accepted deviations come first
        ET.SubElement(props, "property", name="accepted_convention", value=_clean(f"{a['convention']}={a['value']} "
                                                                                   f"(released {a['released']})"))
    for name in ("k3verify_version", "git_sha", "device", "device_name", "preset", "checkpoint_digest", "seed"):
        ET.SubElement(props, "property", name=name, value=_clean(run.get(name)))
    ET.SubElement(props, "property", name="verdict", value=data["summary"]["verdict"])
    missing = data["summary"].get("missing_evidence")
    if missing:  # a CI that reads JUnit must not see an inconclusive run as green
        suite.set("tests", str(len(results) + 1))
        suite.set("failures", str(counts["fail"] + counts["vacuous"] + 1))
        case = ET.SubElement(suite, "testcase", classname="k3verify.verdict", name="verdict.evidence", time="0.000")
        ET.SubElement(case, "failure", message=_clean("inconclusive: the model's outputs were not compared"),
                      type="inconclusive").text = _clean("\n".join(missing))
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"k3verify.{r['component']}", name=r["id"],
                             time=f"{r['duration_s']:.3f}")
        status = r["status"]
        if status in ("fail", "vacuous"):
            node = ET.SubElement(case, "failure", message=_clean(r["reason"]), type=status)
            node.text = _clean("\n".join([_summary_line(r), *r["notes"]]))
        elif status == "error":
            node = ET.SubElement(case, "error", message=_clean(r["reason"]), type="error")
            node.text = _clean(r.get("traceback") or r["reason"])
        elif status == "skipped":
            ET.SubElement(case, "skipped", message=_clean(r["reason"]))
        elif status == EXCUSED:  # a passing testcase that says so in its name and properties
            case.set("name", f"{r['id']} [{status_label(status, r['metrics'])}]")
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="status", value=status_label(status, r["metrics"]))
        ET.SubElement(case, "system-out").text = _clean(_summary_line(r))
    return suite


def _mutation_suite(mutations: list[Mapping[str, Any]]) -> ET.Element:
    suite = ET.Element("testsuite", {
        "name": "k3verify.mutations",
        "tests": str(len(mutations)),
        "failures": str(sum(m["status"] == "survived" for m in mutations)),
        "errors": str(sum(m["status"] == "error" for m in mutations)),
        "skipped": str(sum(m["status"] == "equivalent" for m in mutations)),
    })
    for m in mutations:
        case = ET.SubElement(suite, "testcase", classname="k3verify.mutation", name=m["id"],
                             time=f"{m.get('duration_s', 0.0):.3f}")
        detail = f"target={m['target']} fault={m['fault']} killers={m['killers']} expected={m['expected_killers']}"
        if m["status"] == "survived":
            ET.SubElement(case, "failure", message=_clean(f"survived: {m['fault']}"), type="survived").text = detail
        elif m["status"] == "error":
            ET.SubElement(case, "error", message=_clean(m.get("reason") or "mutant run failed"), type="error")
        elif m["status"] == "equivalent":
            ET.SubElement(case, "skipped", message=_clean(m.get("reason") or "equivalent mutant"))
    return suite


def render_junit(data: Mapping[str, Any]) -> str:
    root = ET.Element("testsuites", name="k3verify")
    root.append(_check_suite(data))
    if data.get("mutations"):
        root.append(_mutation_suite(data["mutations"]))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
