"""Oracle provenance: pinned versions and the sha256 of every oracle source file actually used.

`pins.json` (committed next to this file) holds what the oracle was validated with; reports embed
`oracle_provenance()`, which says for each file whether today's bytes still match. A mismatch is
reported (and fails the `oracle.pins` check), never ignored. Regenerate after a deliberate change:

    python -m k3verify.oracle.pinning --write
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

PINS_PATH = Path(__file__).with_name("pins.json")
_ORACLE_DIR = Path(__file__).parent

# name -> (distribution whose version is pinned, pinned version, import package, files relative to it)
SOURCES: dict[str, tuple[str | None, str | None, str, tuple[str, ...]]] = {
    "transformers": ("transformers", "5.24.0", "transformers", ("models/kimi_linear/modeling_kimi_linear.py",)),
    "fla": ("fla-core", "0.6.0", "fla", ("ops/kda/naive.py", "ops/kda/gate.py")),
    "k3verify.oracle": (None, None, "k3verify.oracle", ("functional.py", "k3_layers.py", "k3_reference.py",
                                                        "fla_ref.py", "hf_kimi_linear.py", "active.py",
                                                        "conventions.py", "precision.py")),
}


def _package_dir(package: str) -> Path | None:
    if package == "k3verify.oracle":
        return _ORACLE_DIR
    # find_spec of a top-level package locates it without executing it (fla would import triton).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _version(distribution: str | None) -> str | None:
    if distribution is None:
        return None
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def sha256_file(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def current_state() -> dict[str, dict[str, Any]]:
    """What is installed now: {name: {version, files: {path: sha256 or None}}}."""
    out: dict[str, dict[str, Any]] = {}
    for name, (dist, _pinned, package, files) in SOURCES.items():
        root = _package_dir(package)
        out[name] = {
            "version": _version(dist),
            "files": {f: (sha256_file(root / f) if root is not None else None) for f in files},
        }
    return out


def load_pins(path: Path = PINS_PATH) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `python -m k3verify.oracle.pinning --write`")
    return json.loads(path.read_text())


def write_pins(path: Path = PINS_PATH) -> dict[str, dict[str, Any]]:
    """Pin today's files. Refuses when an installed version differs from the version pinned in SOURCES."""
    state = current_state()
    pins: dict[str, dict[str, Any]] = {}
    for name, (_dist, pinned_version, _package, _files) in SOURCES.items():
        if pinned_version is not None and state[name]["version"] != pinned_version:
            raise RuntimeError(f"{name} {state[name]['version']} is installed but {pinned_version} is pinned; "
                               f"install the pinned version before writing pins")
        missing = [f for f, sha in state[name]["files"].items() if sha is None]
        if missing:
            raise FileNotFoundError(f"{name}: oracle source file(s) not found: {missing}")
        pins[name] = {"version": pinned_version, "files": state[name]["files"]}
    path.write_text(json.dumps(pins, indent=2, sort_keys=True) + "\n")
    return pins


def oracle_provenance(pins: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """{name: {version, pinned_version, version_matches, files: {path: {sha256, pinned_sha256, matches}}}}."""
    pins = load_pins() if pins is None else pins
    state = current_state()
    out: dict[str, dict[str, Any]] = {}
    for name, now in state.items():
        pinned = pins.get(name, {})
        pinned_files = pinned.get("files", {})
        files = {path: {"sha256": sha, "pinned_sha256": pinned_files.get(path),
                        "matches": sha is not None and sha == pinned_files.get(path)}
                 for path, sha in now["files"].items()}
        out[name] = {"version": now["version"], "pinned_version": pinned.get("version"),
                     "version_matches": now["version"] == pinned.get("version"), "files": files}
    return out


def mismatches(provenance: dict[str, dict[str, Any]]) -> list[str]:
    """One line per version or file that does not match its pin (empty when all match)."""
    lines = []
    for name, entry in provenance.items():
        if not entry["version_matches"]:
            lines.append(f"{name}: version {entry['version']} != pinned {entry['pinned_version']}")
        for path, f in entry["files"].items():
            if not f["matches"]:
                lines.append(f"{name}/{path}: sha256 {f['sha256']} != pinned {f['pinned_sha256']}")
    return lines


def report_pins() -> dict[str, Any]:
    """What a report records: oracle_provenance() plus a `mismatches` list (empty when every pin holds)."""
    provenance = oracle_provenance()
    return {"sources": provenance, "mismatches": mismatches(provenance)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3verify.oracle.pinning", description=__doc__)
    parser.add_argument("--write", action="store_true", help="pin the currently installed oracle files")
    args = parser.parse_args(argv)
    if args.write:
        write_pins()
        print(f"wrote {PINS_PATH}")
    bad = mismatches(oracle_provenance())
    for line in bad:
        print(f"MISMATCH {line}")
    if not bad:
        print("oracle pins match")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
