"""Memory planning for tensor/expert-parallel serving: per-rank bytes on the meta device (`k3verify plan`)."""
