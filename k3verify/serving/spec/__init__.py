"""Speculative decoding: drafters, the verify pass with KDA records, acceptance, commit, engine step."""
