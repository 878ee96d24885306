"""The access log never holds a secret: uvicorn logs each request's path with its query string, and a client that
puts its key in the URL (`?api_key=...`, a habit of some SDKs) would leave it in every log line. The query string
is dropped from access-log records (the path and status stay); the server reads keys from the Authorization
header only."""

from __future__ import annotations

import logging

ACCESS_LOGGER = "uvicorn.access"
PATH_ARG = 2  # uvicorn's access record args: (client, method, path with query, http version, status)


class DropQueryString(logging.Filter):
    """Replaces `path?query` by `path?(query not logged)` in uvicorn's access-log records."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) <= PATH_ARG:
            return True
        target = args[PATH_ARG]
        if isinstance(target, str) and "?" in target:
            record.args = (*args[:PATH_ARG], f"{target.partition('?')[0]}?(query not logged)", *args[PATH_ARG + 1:])
        return True


def redact_access_log() -> None:
    """Install the filter on uvicorn's access logger (once per process)."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, DropQueryString) for f in logger.filters):
        logger.addFilter(DropQueryString())
