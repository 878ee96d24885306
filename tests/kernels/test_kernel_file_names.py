"""Kernel files are named by their role, one scheme for every op package under k3verify/kernels/:

- `*_kernel.py`: Triton kernels, and the only modules that import triton;
- `*_launch.py`: the host side that picks a launch and calls a kernel (ours or fla's);
- `torch_ref.py` / `*_ref.py`: plain-torch references, importing no triton and no kernel module;
- any other name: an op composed of the above in torch (no triton import).

The retired suffixes (`_triton`, `_impl`, `_path`, `_kernels`) said the same roles four ways.
"""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "k3verify" / "kernels"
RETIRED = ("_triton.py", "_impl.py", "_path.py", "_kernels.py")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def naming_violations(root: Path) -> list[str]:
    found = []
    for path in sorted(root.glob("*/*.py")):
        name, rel = path.name, path.relative_to(root)
        imports = _imports(path)
        uses_triton = any(i == "triton" or i.startswith("triton.") for i in imports)
        if name.endswith(RETIRED):
            found.append(f"{rel}: a retired suffix; name it *_kernel.py, *_launch.py or *_ref.py by its role")
        if uses_triton and not name.endswith("_kernel.py"):
            found.append(f"{rel}: imports triton but is not a *_kernel.py")
        if name.endswith("_kernel.py") and not uses_triton:
            found.append(f"{rel}: named *_kernel.py but holds no Triton code")
        if name.endswith("_ref.py") and any(i.rsplit(".", 1)[-1].endswith("_kernel") for i in imports):
            found.append(f"{rel}: a reference that imports a kernel module")
    return found


def test_every_kernel_file_is_named_by_its_role() -> None:
    assert list(KERNELS.glob("*/*_kernel.py")), "the scheme has kernels to hold"
    assert naming_violations(KERNELS) == []


def test_the_rule_names_each_kind_of_misnamed_file(tmp_path: Path) -> None:
    op = tmp_path / "op"
    op.mkdir()
    (op / "fast_triton.py").write_text("import triton\n")
    (op / "sum_kernel.py").write_text("import torch\n")
    (op / "torch_ref.py").write_text("from k3verify.kernels.op import sum_kernel\n")
    (op / "launch_helpers.py").write_text("from triton import language as tl\n")
    (op / "good_kernel.py").write_text("import triton\n")
    found = naming_violations(tmp_path)
    assert len(found) == 5, found
    assert any("op/fast_triton.py: a retired suffix" in f for f in found)
    assert any("op/fast_triton.py: imports triton" in f for f in found)
    assert any("op/sum_kernel.py: named *_kernel.py" in f for f in found)
    assert any("op/torch_ref.py: a reference" in f for f in found)
    assert any("op/launch_helpers.py: imports triton" in f for f in found)
