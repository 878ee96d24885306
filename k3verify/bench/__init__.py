"""GPU benchmarks: our serving model against the transformers+fla baseline, on the same weights and inputs."""
