"""endpoint.* checks: an OpenAI-compatible server judged against the oracle."""
