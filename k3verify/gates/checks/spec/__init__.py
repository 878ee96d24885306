"""spec.* checks: speculative decoding against plain decoding."""
