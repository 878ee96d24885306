"""Shared pytest set-up: GPU tests are skipped with a printed reason when CUDA is absent, every
test runs with one torch thread (the models are tiny: on the shared 2-core runner two spinning
OpenMP threads make each small fp32 GEMM ~20 ms instead of ~10 us), and the test run as a whole must
leave the checkout's reports/ as it found it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from reports_guard import CHECKOUT_REPORTS, reports_state


@pytest.fixture(scope="session", autouse=True)
def _checkout_reports_untouched() -> Iterator[None]:
    """No test writes into the checkout's reports/ (a narrowed or failing run written to reports/latest would replace
    a user's passing report, and `serve` would then refuse): every test passes --report-dir under its tmp_path."""
    before = reports_state()
    yield
    after = reports_state()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test run wrote into {CHECKOUT_REPORTS}: {', '.join(changed[:10])}"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def cuda_moe_combine() -> Iterator[None]:
    """Route the MoE combine to its CUDA implementation (bf16 grouped GEMMs, fp32 per-pair gather) on CPU, as
    dispatch picks it on the GPU."""
    from k3verify.kernels.moe import COMBINE
    from k3verify.kernels.registry import CUDA, REGISTRY

    REGISTRY.force(COMBINE, CUDA)
    yield
    REGISTRY.force(COMBINE, None)


# Tests run on two pytest-xdist workers (pyproject's addopts): with one torch thread a test, a serial run leaves the
# second core idle. A file's tests stay on one worker (its module fixtures are built once); folders whose files share
# session fixtures (a llama.cpp conversion, a checkpoint) stay together as one group; a module that sets
# XDIST_SPREAD = True (a few long, independent tests) has its tests handed out one by one, and a test marked
# xdist_group(NAME) keeps that group (a long test that shares no fixture with its file's others).
SHARED_SESSION_FOLDERS = ("peers", "checkpoint")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root) if item.path.is_relative_to(root) else item.path
        folder = rel.parts[1] if len(rel.parts) > 2 and rel.parts[0] == "tests" else ""
        if getattr(getattr(item, "module", None), "XDIST_SPREAD", False) or item.get_closest_marker("xdist_group"):
            continue  # handed out alone, or already in the group its test names
        group = folder if folder in SHARED_SESSION_FOLDERS else rel.as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine (run on the H200 with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
