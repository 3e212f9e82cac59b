"""Benchmarks: measure the parts of splitrl that decide how fast the link is."""
