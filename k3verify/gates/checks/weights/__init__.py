"""weights.* checks: loading and reconciling a checkpoint."""
