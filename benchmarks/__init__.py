"""Kernel microbenchmarks and one-off probes, run from the repository root as
`python -m benchmarks.NAME` (README.md lists them); not part of the installed package."""
