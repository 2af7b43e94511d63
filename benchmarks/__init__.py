"""Benchmarks and the yardstick suites of hf_mloss (not part of the library wheel)."""
