"""xdist's work order when .ci/run builds llama.cpp beside the tests (K3V_LLAMACPP_PENDING names the status file the
build writes when it ends): a work unit of tests/peers/ would only wait on its worker for the build, so while the
file is absent the next unit handed out is the first one outside tests/peers/; once the build has ended, or when
nothing else is left, the queue's own order (largest group first) holds."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

WAITS_FOR_BUILD = "tests/peers/"


def defer_build_waiters(workqueue: OrderedDict[str, dict[str, bool]], build_done: bool) -> None:
    """Move the first unit that does not wait for the build to the queue's front, unless the build is done."""
    if build_done:
        return
    for scope, unit in workqueue.items():
        if not any(nodeid.startswith(WAITS_FOR_BUILD) for nodeid in unit):
            workqueue.move_to_end(scope, last=False)
            return


def make_scheduler(config: Any, log: Any) -> Any | None:
    """The loadgroup scheduler with the deferral above, or None (xdist's own) without a pending build."""
    pending = os.environ.get("K3V_LLAMACPP_PENDING")
    if not pending or config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    status = Path(pending)

    class BuildAwareScheduling(LoadGroupScheduling):  # type: ignore[misc]
        def _assign_work_unit(self, node: Any) -> None:
            defer_build_waiters(self.workqueue, status.is_file())
            super()._assign_work_unit(node)

    return BuildAwareScheduling(config, log)

