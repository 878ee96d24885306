"""Where `serve`'s API key comes from: `--api-key KEY` (visible to every user in `ps`), `--api-key-file FILE` or the
K3V_API_KEY environment variable, exactly one of them. A key file holds the key on its first line (a trailing
newline is not part of it); whitespace inside or around the key is refused later, by the server, naming it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from k3verify.errors import UsageError

API_KEY_ENV = "K3V_API_KEY"
log = logging.getLogger(__name__)


def resolve_api_key(flag: str | None, path: Path | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key from exactly one source (None: none given); UsageError naming the sources when two are given or the
    file cannot be read. The key itself never appears in a message."""
    environ = os.environ if environ is None else environ
    from_env = environ.get(API_KEY_ENV)
    given = [name for name, value in (("--api-key", flag), ("--api-key-file", path), (API_KEY_ENV, from_env))
             if value is not None]
    if len(given) > 1:
        raise UsageError(f"the API key is given by {' and '.join(given)}: give it one way only")
    if flag is not None:
        log.warning("--api-key on the command line is visible to every user of this machine (ps); prefer "
                    "--api-key-file FILE or the %s environment variable", API_KEY_ENV)
        return flag
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--api-key-file {path}: cannot be read: {getattr(exc, 'strerror', None) or exc}") \
                from None
        return text[:-1] if text.endswith("\n") else text
    return from_env
