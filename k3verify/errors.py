"""The error every layer raises for a usage or setup problem; the CLI reports it on stderr with exit code 2.

Its own module so the gates and the commands can raise it without importing the CLI that catches it."""

from __future__ import annotations


class UsageError(Exception):
    """A usage or setup problem: reported on stderr with exit code 2."""
