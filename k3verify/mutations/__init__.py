"""The mutation catalog: one `MUTANTS` list per file, each entry a modelled fault and the checks that must kill it
(README.md here says how to write one; gates/mutation/runner.py loads and runs them). Shipped with the package, so
`k3verify mutate` finds it from any installation."""
