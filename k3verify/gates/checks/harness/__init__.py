"""gates.selftest.* checks: the comparison machinery itself."""
