"""The repository's tools (``python -m scripts.compile_for_hopper``, ``python scripts/fix_env.py``); a package so the
benchmarks import ``scripts.compile_for_hopper`` by name. ``scripts/device/``: the GPU machine's calls."""
