"""Benchmarks that print figures: throughput against DBOS, claims, the suite, start-up."""
