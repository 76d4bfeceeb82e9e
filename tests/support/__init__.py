"""Helpers the tests share (the tests' own, never imported by the product or the benches)."""
