"""The error every layer raises for a usage or setup problem; the CLI reports it on stderr with exit code 2.

Its own module so the gates and the commands can raise it without importing the CLI that catches it."""

from __future__ import annotations


class UsageError(Exception):
    """A usage or setup problem: reported on stderr with exit code 2."""


class BadTargetData(UsageError):
    """The target's own stored data is unusable (a NaN or Inf in a checkpoint tensor as stored): every check that
    loads it would fail the same way, so a run stops at the first that finds it and reports it once (exit 2)."""
