"""Whether `serve` believes a report: what is re-derived from it (rederive) and the lookup of the deciding report
(lookup); the report's binding to code, checkpoint and key is core/binding.py, which the runner writes with."""
