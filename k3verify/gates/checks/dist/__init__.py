"""dist.* checks: the tensor- and expert-parallel model against the single-process one."""
