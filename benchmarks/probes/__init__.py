"""Probes and prototypes behind past decisions, kept to reproduce the results the pages cite from them; not maintained
benchmarks, and nothing under tests/ imports them (benchmarks/README.md, ``probes/``)."""
