"""Every module under lab/ and tools/ imports on a CPU machine, so a script that only runs on a GPU (or by hand)
cannot break unseen when the package moves under it: an import of a renamed module, or a top-level statement
that needs CUDA, fails here (scripts keep their work under `if __name__ == "__main__"`). One child interpreter
imports them all, each in its own try, beside planted modules that must fail (the detector's control)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("lab", "tools")
# planted beside the real modules: the two breaks the test exists for, and a guarded script that must pass
PLANTS = {
    "k3v_plant_moved": "from k3verify.gates.fixtures import patched\n",
    "k3v_plant_unguarded": "import torch\n\ntorch.cuda.get_device_name()\n",
    "k3v_plant_guarded": "import torch\n\n\ndef main() -> None:\n    torch.cuda.get_device_name()\n\n\n"
                         "if __name__ == '__main__':\n    main()\n",
}


def script_modules(root: Path = ROOT) -> list[str]:
    """Dotted names of every .py under lab/ and tools/ (a package is named by its __init__.py)."""
    out = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


def import_failures(modules: list[str], path: list[Path]) -> dict[str, str]:
    """module -> the last line of its import's traceback, for each module that does not import (CUDA hidden)."""
    code = ("import importlib, sys, traceback\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except BaseException:\n"
            "        print('FAILED ' + name + ' ' + traceback.format_exc().strip().splitlines()[-1])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path)), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(line[len("FAILED "):].partition(" ")[::2] for line in proc.stdout.splitlines()
                if line.startswith("FAILED "))


def test_every_lab_and_tools_module_imports_on_cpu_and_planted_breaks_fail(tmp_path: Path) -> None:
    modules = script_modules()
    assert len(modules) > 20 and "lab.gpu.gpu_probe" in modules and "tools.chaos" in modules, modules
    for name, source in PLANTS.items():
        (tmp_path / f"{name}.py").write_text(source)
    failed = import_failures([*modules, *PLANTS], [ROOT, tmp_path])
    assert sorted(failed) == ["k3v_plant_moved", "k3v_plant_unguarded"], (
        f"lab/tools modules that do not import (or a planted break that was not caught): {failed}")
