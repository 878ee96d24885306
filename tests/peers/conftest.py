"""llama.cpp as a peer: the session's installation (K3V_LLAMACPP_DIR, made by tools/build_llamacpp.sh), or a skip
that says how to get one. With K3V_REQUIRE_LLAMACPP=1 (as .ci/run sets it) a missing installation fails instead:
CI must never pass by skipping the peer."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "acceptance"))  # hf_checkpoint: a transformers-written checkpoint

from hf_checkpoint import write_hf_checkpoint  # noqa: E402

from k3verify.peers.llamacpp import LlamaCpp, LlamaCppError  # noqa: E402

BUILD_WAIT_S = 1800  # the build's own budget in .ci/run: it takes 5-8 min on 2 cores


def wait_for_build() -> None:
    """With K3V_LLAMACPP_PENDING=FILE (.ci/run starts the build in the background and runs the tests beside it),
    wait until the build writes its exit status to FILE; a failed build fails the tests with its log's tail."""
    status = os.environ.get("K3V_LLAMACPP_PENDING")
    if not status:
        return
    path, waited = Path(status), 0.0
    while not path.is_file():
        if waited >= BUILD_WAIT_S:
            pytest.fail(f"the llama.cpp build did not finish in {BUILD_WAIT_S} s ({path} never written)")
        time.sleep(2.0)
        waited += 2.0
    code = path.read_text().strip()
    if code != "0":
        log = path.with_suffix(".log")
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.is_file() else "(no log)"
        pytest.fail(f"the llama.cpp build failed (exit {code}); the end of {log}:\n{tail}")


@pytest.fixture(scope="session")
def llamacpp() -> LlamaCpp:
    wait_for_build()
    try:
        return LlamaCpp.from_env()
    except LlamaCppError as exc:
        if os.environ.get("K3V_REQUIRE_LLAMACPP") == "1":
            pytest.fail(f"K3V_REQUIRE_LLAMACPP=1 but llama.cpp is not available: {exc}")
        pytest.skip(f"llama.cpp not available ({exc}); `bash tools/build_llamacpp.sh .llamacpp` and "
                    "K3V_LLAMACPP_DIR=.llamacpp run these tests")


@pytest.fixture(scope="session")
def kl_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' save_pretrained of a tiny Kimi-Linear, one head count for KDA and MLA (llama.cpp's graph
    assumes it), the dense MLP under the released checkpoints' name."""
    out = tmp_path_factory.mktemp("kl") / "checkpoint"
    write_hf_checkpoint(out, kda_heads=4, released_spelling=True)
    return out


@pytest.fixture(scope="session")
def kl_gguf(llamacpp: LlamaCpp, kl_checkpoint: Path) -> Path:
    return llamacpp.convert(kl_checkpoint, kl_checkpoint.parent / "kl-f32.gguf")

