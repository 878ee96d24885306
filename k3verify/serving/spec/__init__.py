"""Speculative decoding: drafters, the score pass with KDA records, acceptance, commit, engine step."""
