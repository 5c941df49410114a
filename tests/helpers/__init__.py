"""What the test modules share: tolerances and float64 checks of kernels, the DCP case runner over threads, engine
stand-ins and checks for vLLM and SGLang. Imported by the tests only (never by benchmarks or the product)."""
