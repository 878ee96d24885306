"""kernel.* checks: each fast-path kernel against its torch reference."""
