"""Benchmarks (not tests): each prints a table and writes JSON under bench/out/; `harness` is what they share."""
