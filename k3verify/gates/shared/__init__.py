"""What check modules (and the bench and commands that reuse their trials) share: cached models and inputs, route
pins, graph replay, dist sessions, the endpoint oracle, spec cases, patching. No check module imports another."""
