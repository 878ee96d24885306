"""k3verify: parity gates, mutation proofs and an OpenAI-compatible server for Kimi-K3 / Kimi-Linear."""

__version__ = "0.1.0"
