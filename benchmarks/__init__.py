"""dcp-triton's benchmarks, a package run from the repository root: ``python -m benchmarks.<folder>.<script>``
(benchmarks/README.md: what each measures, where its results go, how the GPU machine runs them)."""
