"""tokenizer.* checks: encoding, chat rendering and streaming against pinned ids."""
