"""Independent references: an eager K3 / Kimi-Linear decoder written from SPEC-K3, fla's KDA
references and kernels behind signature probes, and transformers' KimiLinear. Imports nothing from
serving/ or kernels/ (tests/oracle/test_oracle_isolation.py enforces it)."""

from k3verify.oracle.fla_ref import OracleMismatch
from k3verify.oracle.k3_reference import K3Reference, ReferenceOutput

__all__ = ["K3Reference", "OracleMismatch", "ReferenceOutput"]
