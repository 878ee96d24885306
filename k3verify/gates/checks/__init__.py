"""Imports every module in this folder so their @register_check decorators run: drop a file here and
its checks exist. A module that fails to import is recorded in IMPORT_ERRORS (module -> traceback)
rather than raised, and the runner turns each entry into an `error` result: a broken check file must
make the run red, not silently remove its gates."""

from __future__ import annotations

import importlib
import pkgutil
import traceback

IMPORT_ERRORS: dict[str, str] = {}


def _import_all() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        try:
            importlib.import_module(name)
        except Exception:
            IMPORT_ERRORS[name] = traceback.format_exc()


_import_all()
