"""What every `k3verify` process imports before it does anything: no torch._dynamo (1.5 s of start-up, paid by each
server, mutation child and parity subprocess), which torch.nn.attention.bias pulls in; code that needs it imports
it where it is used."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_check_modules_do_not_import_torch_dynamo() -> None:
    code = ("import sys, k3verify.cli, k3verify.gates.checks, k3verify.api.api_process, k3verify.serving.model; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"imported at start-up: {done.stdout.strip()}"
