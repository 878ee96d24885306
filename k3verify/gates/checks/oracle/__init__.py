"""oracle.* checks: the reference against independent references."""
