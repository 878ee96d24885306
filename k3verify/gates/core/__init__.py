"""The check model and its runner: what a check is, the registry, comparisons, evaluation, noise-derived bars,
evidence, the verdict and binding rules a report is written (and re-read) with, and the suite runner."""
