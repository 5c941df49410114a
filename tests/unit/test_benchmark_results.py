"""benchmarks/results/ holds only cited results, and every citation names a file that is there: each results file is
listed in the index (benchmarks/README.md) and cited outside benchmarks/ (the README, docs/, or the code it backs), and
every results file, benchmark script (by its path, or the module a command runs) or device script that the pages name
exists. A results file that left the tree is cited as it was in the git history, `<commit>:benchmarks/results/NAME` (a
7- or 40-digit commit, as `git show` takes it): that names no file of the tree, and the commit must hold it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = ROOT / "benchmarks" / "README.md"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), INDEX)
CODE = ("kernels", "dcp_plugin", "adapters", "tests")  # code whose comments or checks may cite a result
# A results file's name: what ran, the device (h200, 2xh200, cpu, ...), then what of it; a page names it bare or
# under benchmarks/results/.
NAME = (r"([a-z0-9_]+_(?:cpu|(?:\d+x)?[a-z]{1,3}\d{2,4})(?:_[a-z0-9_]+)?\.(?:json|md|png|log|log\.gz|csv\.gz|tar\.gz))"
        r"(?![\w.-])")
RESULT_NAME = re.compile(r"(?<![\w/.-])(?:benchmarks/results/)?" + NAME)
# A results file of the git history, not of the tree: `<commit>:benchmarks/results/NAME`, as `git show` takes it.
HISTORY_CITATION = re.compile(r"(?<![\w/.:-])([0-9a-f]{40}|[0-9a-f]{7}):benchmarks/results/" + NAME)
SCRIPT_PATH = re.compile(r"(?<![\w/.-])((?:benchmarks|scripts)/[\w/.-]+\.(?:py|sh))(?![\w.-])")
# A command runs a script as its module, from the repository root: `python -m benchmarks.kernels.bench_oneshot`.
SCRIPT_MODULE = re.compile(r"(?<![\w.-])-m +((?:benchmarks|scripts)(?:\.\w+)+)")


def tracked_results() -> set[str]:
    """The files under benchmarks/results/ that a commit or a copy of the tree to the GPU machine takes: tracked, or
    untracked and not ignored; without git, every file there."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "--",
                             "benchmarks/results"], capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        return {str(Path(line).relative_to("benchmarks/results")) for line in listed.stdout.splitlines()}
    return {str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*") if path.is_file()}


def live_names(text: str) -> set[str]:
    """The results files a text names in the tree: every name but those cited at a commit of the history."""
    return {match[1] for match in RESULT_NAME.finditer(HISTORY_CITATION.sub(" ", text))}


def names_in(paths) -> set[str]:
    return {name for path in paths for name in live_names(path.read_text(errors="replace"))}


def history_citations(paths) -> set[tuple[str, str]]:
    return {(match[1], match[2]) for path in paths
            for match in HISTORY_CITATION.finditer(path.read_text(errors="replace"))}


def code_files() -> list[Path]:
    this = Path(__file__).resolve()
    return [path for folder in CODE for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() != this]


def test_the_name_pattern_knows_results_files_from_other_names():
    text = ("`kernels_h200_sweep2.json`, benchmarks/results/vllm_dcp_2xh200_jobs.tar.gz, server_aborts_cpu.log.gz, "
            "`vllm_one_h200.py`, MODEL/config.json, `vllm_one_h200_*.json`, docs/performance.md, x_h200.jsonl, "
            "ncu_attention_h200_raw.csv.gz, attention_raw.csv")
    assert {m[1] for m in RESULT_NAME.finditer(text)} == {
        "kernels_h200_sweep2.json", "vllm_dcp_2xh200_jobs.tar.gz", "server_aborts_cpu.log.gz",
        "ncu_attention_h200_raw.csv.gz"}


def test_a_citation_at_a_commit_names_no_file_of_the_tree():
    text = ("`47214dc:benchmarks/results/kernels_h200_sweep_tma.json`, git show "
            "47214dc0123456789abcdef0123456789abcdef0:benchmarks/results/gpu_tests_h200.log, "
            "benchmarks/results/kernels_h200.json, x47214dc:benchmarks/results/dcp_sim_h200.json, "
            "47214d:benchmarks/results/vllm_one_h200.json, 47214dc:kernels_h200_sweep2.json")
    assert {(m[1], m[2]) for m in HISTORY_CITATION.finditer(text)} == {
        ("47214dc", "kernels_h200_sweep_tma.json"),
        ("47214dc0123456789abcdef0123456789abcdef0", "gpu_tests_h200.log")}
    # Not a history citation: a longer word before the hash, a 6-digit hash, a hash without benchmarks/results/.
    assert live_names(text) == {"kernels_h200.json", "dcp_sim_h200.json", "vllm_one_h200.json",
                                "kernels_h200_sweep2.json"}


def test_every_results_file_cited_at_a_commit_is_in_that_commit():
    cited = history_citations(PAGES) | history_citations(code_files())
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        pytest.skip("no git: the history cannot be read")
    missing = sorted(f"{commit}:benchmarks/results/{name}" for commit, name in cited
                     if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e",
                                        f"{commit}:benchmarks/results/{name}"], capture_output=True).returncode != 0)
    assert not missing, f"citations of results at a commit that the commit does not hold: {missing}"


def test_every_results_file_is_in_the_index():
    unlisted = tracked_results() - names_in([INDEX])
    assert not unlisted, f"benchmarks/results/ files that benchmarks/README.md does not list: {sorted(unlisted)}"


def test_every_results_file_is_cited_outside_benchmarks():
    cited = names_in(PAGES[:-1]) | names_in(code_files())
    uncited = tracked_results() - cited
    assert not uncited, (f"results no page (README.md, docs/) and no code cites: {sorted(uncited)}; cite what a page "
                         "quotes, or take the file out of the tree")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_results_file_a_page_names_exists(page):
    missing = names_in([page]) - tracked_results()
    assert not missing, f"{page.relative_to(ROOT)} names results that benchmarks/results/ lacks: {sorted(missing)}"


def named_scripts(text: str) -> set[str]:
    """The scripts a text names: by path (a citation), or as the module a command runs (``-m benchmarks.x.y``)."""
    return ({m[1] for m in SCRIPT_PATH.finditer(text)}
            | {m[1].replace(".", "/") + ".py" for m in SCRIPT_MODULE.finditer(text)})


def test_a_script_is_named_by_its_path_or_by_its_module():
    text = ("`benchmarks/kernels/bench_kernels.py`, `python -m benchmarks.kernels.bench_oneshot --dry-run`, "
            "`torchrun --nproc-per-node 2 -m benchmarks.dcp.multi_gpu_dcp`, `bash scripts/device/run_h200.sh`, "
            "`python -m pytest`, `python -m scripts.compile_for_hopper`, dcp_plugin.kernels.prefix_attention")
    assert named_scripts(text) == {"benchmarks/kernels/bench_kernels.py", "benchmarks/kernels/bench_oneshot.py",
                                   "benchmarks/dcp/multi_gpu_dcp.py", "scripts/device/run_h200.sh",
                                   "scripts/compile_for_hopper.py"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_a_page_names_exists(page):
    named = named_scripts(page.read_text())
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"{page.relative_to(ROOT)} names scripts that are not there: {missing}"


def test_the_index_names_every_benchmark_script():
    scripts = {str(path.relative_to(ROOT / "benchmarks")) for path in (ROOT / "benchmarks").rglob("*.py")
               if path.name != "__init__.py"}  # the package's folders, not scripts
    text = INDEX.read_text()
    unnamed = sorted(s for s in scripts if Path(s).name not in text)
    assert not unnamed, f"benchmarks/README.md does not say where these belong: {unnamed}"
