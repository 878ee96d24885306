"""The OpenAI-compatible HTTP server over k3verify.serving's Engine (needs the `serve` extra: fastapi, uvicorn)."""
