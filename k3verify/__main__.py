"""`python -m k3verify ...` runs the CLI."""

import sys

from k3verify.cli import main

sys.exit(main())
