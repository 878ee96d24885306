"""`python -m k3verify ...` runs the CLI (one import of k3verify.cli, so UsageError is caught)."""

import sys

from k3verify.cli import main

sys.exit(main())
