"""Speculative-decoding verify steps under DCP equal float64 causal attention, on DCP = 1, 2, 4 gloo processes (the
cases and their runner: tests/helpers/verify_steps.py). Both head layouts, both comm modes, interleave 1 and 16 (block
size 16), reference kernels; draft trees (the batch's chunk_mask); a few small cases run the Triton kernels
(interpreter).
"""

from __future__ import annotations

import pytest

from tests.integration.dcp_procs import GROUP_KEY, OK, run_group
from tests.helpers.verify_steps import MIXES, VerifyCase, head_layouts, run_verify_case, verify_case

GROUP_SIZES = (1, 2, 4)
GROUP_TIMEOUT_S = 300


def cases(n: int) -> list[VerifyCase]:
    made = []
    for layout, heads in head_layouts(n).items():
        for comm in ("ag_rs", "a2a"):
            for interleave in (1, 16):
                for mix in MIXES:
                    made.append(verify_case(f"{layout}-{comm}-I{interleave}-{mix}", mix, seed=len(made) + 100 * n,
                                            comm=comm, interleave=interleave, **heads))
    # Draft trees (a proposal sees its ancestors: the batch's chunk_mask), each layout with one comm mode.
    for layout, heads in head_layouts(n).items():
        comm = "a2a" if layout == "replicated" else "ag_rs"
        made.append(verify_case(f"trees-{layout}-{comm}", "verify-first", seed=len(made) + 100 * n, comm=comm,
                                trees=True, expect=("verify", "rejected", "tree"), **heads))
    # One small case on the Triton kernels under the interpreter (fp32/fp16: it computes bf16 products wrongly).
    mix, layout, steps = ("verify-only", "tp", 3) if n == 1 else ("decodes-first", "replicated", 2)
    made.append(verify_case(f"triton-{layout}-{mix}", mix, seed=7 * n, kernel_impl="triton", head_dim=32, steps=steps,
                            comm="a2a" if n == 2 else "ag_rs", interleave=16 if n == 2 else 1,
                            dtype="float16" if n == 2 else "float32", **head_layouts(n)[layout]))
    made.append(verify_case("triton-trees-replicated", "verify-only", seed=11 * n, kernel_impl="triton", head_dim=32,
                            steps=2, trees=True, expect=("verify", "tree"), **head_layouts(n)["replicated"]))
    return made


_RESULTS: dict[int, dict[str, str]] = {}


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    def results(n: int) -> dict[str, str]:
        if n not in _RESULTS:
            _RESULTS[n] = run_group(n, cases(n), tmp_path_factory.mktemp(f"spec{n}"), timeout_s=GROUP_TIMEOUT_S,
                                    runner=run_verify_case)
        return _RESULTS[n]

    return results


@pytest.mark.parametrize("n, name", [(n, c.name) for n in GROUP_SIZES for c in cases(n)],
                         ids=[f"N{n}-{c.name}" for n in GROUP_SIZES for c in cases(n)])
def test_verify_steps_match_single_rank_attention(group_results, n, name):
    results = group_results(n)
    if name not in results:
        pytest.fail(f"case {name} did not run:\n{results.get(GROUP_KEY, 'no verdict and no group error')}")
    assert results[name] == OK, results[name]


@pytest.mark.parametrize("n", GROUP_SIZES, ids=[f"N{n}" for n in GROUP_SIZES])
def test_process_group_ran_cleanly(group_results, n):
    results = group_results(n)
    assert GROUP_KEY not in results, results[GROUP_KEY]
