"""One module per CLI subcommand; each exposes register(subparsers)."""

from __future__ import annotations

import argparse
from typing import TypeAlias

# What each command's `register` receives (a string alias: the class is not subscriptable at run time).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
