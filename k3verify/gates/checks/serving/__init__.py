"""The serving model, its modules and its engine against the oracle."""
