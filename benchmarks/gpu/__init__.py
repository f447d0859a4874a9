"""Benchmarks and checks that need a GPU (`run.sh` runs them in one call)."""
