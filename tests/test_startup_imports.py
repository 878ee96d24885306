"""What every `k3verify` process imports before it does anything: no torch._dynamo (1.5 s of start-up, paid by each
server, mutation child and parity subprocess), which torch.nn.attention.bias pulls in; code that needs it imports
it where it is used. And what it sets before it does anything: Triton's autotune cache on."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_the_cli_and_the_check_modules_do_not_import_torch_dynamo() -> None:
    code = ("import sys, k3verify.cli, k3verify.gates.checks, k3verify.api.api_process, k3verify.serving.model; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"imported at start-up: {done.stdout.strip()}"


def test_the_cli_keeps_triton_autotune_picks_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every k3verify command (and the processes it starts) caches Triton's autotune picks on disk; an explicit
    TRITON_CACHE_AUTOTUNING is left as the user set it."""
    import os

    from k3verify import cli

    monkeypatch.delenv(cli.AUTOTUNE_CACHE_ENV, raising=False)
    assert cli.main([]) == 2  # no command: the help, and the defaults in place
    assert os.environ[cli.AUTOTUNE_CACHE_ENV] == "1"
    monkeypatch.setenv(cli.AUTOTUNE_CACHE_ENV, "0")
    cli.main([])
    assert os.environ[cli.AUTOTUNE_CACHE_ENV] == "0"
