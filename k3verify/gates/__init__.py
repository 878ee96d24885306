"""The gate engine: comparisons, check registry, runner and reports.

Check writers need only: register_check, Trial, SkipCheck, CheckContext, Kind (docs/CHECK-API.md).
"""

from k3verify.gates.core.check import (
    REGISTRY,
    Check,
    CheckContext,
    Registry,
    Result,
    SkipCheck,
    Status,
    Trial,
    register_check,
)
from k3verify.gates.core.compare import (
    BF16_ATOL,
    BF16_MAX_FAIL_FRACTION,
    BF16_RTOL,
    RMS_DEFAULT_BAR,
    THIN_MARGIN,
    Comparison,
    Kind,
    WorstElement,
    compare,
)
from k3verify.gates.core.evaluate import evaluate_trial
from k3verify.gates.core.suite import (
    RunInfo,
    RunResult,
    collect_run_info,
    load_all_checks,
    make_context_factory,
    run_suite,
    select_checks,
)

__all__ = [
    "BF16_ATOL", "BF16_MAX_FAIL_FRACTION", "BF16_RTOL", "REGISTRY", "RMS_DEFAULT_BAR", "THIN_MARGIN", "Check",
    "CheckContext", "Comparison", "Kind", "Registry", "Result", "RunInfo", "RunResult", "SkipCheck", "Status",
    "Trial", "WorstElement", "collect_run_info", "compare", "evaluate_trial", "load_all_checks", "make_context_factory",
    "register_check", "run_suite", "select_checks",
]
