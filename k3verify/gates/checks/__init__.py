"""Imports every module in this folder and its concern folders (serving/, kernels/, ...) so their @register_check
decorators run: drop a file into one and its checks exist. A module that fails to import is recorded in
IMPORT_ERRORS (module -> traceback) rather than raised, and the runner turns each entry into an `error` result: a
broken check file must make the run red, not silently remove its gates. Check modules import no other check module:
what two of them share lives in gates/shared/."""

from __future__ import annotations

import importlib
import pkgutil
import traceback
from collections.abc import Iterable

IMPORT_ERRORS: dict[str, str] = {}


def _import_all(path: Iterable[str], package: str) -> None:
    for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = f"{package}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception:
            IMPORT_ERRORS[name] = traceback.format_exc()
            continue
        if info.ispkg:
            _import_all(module.__path__, name)


_import_all(__path__, __name__)
