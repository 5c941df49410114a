# shellcheck shell=bash
# What the device scripts share (run_h200.sh, run_2xh200.sh, run_h200_v033.sh, run_h200_sglang.sh source this
# first): the repository root ($repo), dcp-triton's install into /tmp/dcp, vLLM 0.26's core archive into /tmp/vs,
# split archives joined and checked, and the archive of new result files. vLLM's core archive (58 MiB) no longer
# fits beside the repository (~12 MiB) in one device call (64 MiB): scripts/device/split_bundle026.sh splits it into
# .gpu-bundle/core-part (44 MiB), carried by an `unpack` call that keeps it in /tmp, and .gpu-bundle/core-rest (the
# rest and the whole archive's SHA256SUMS), carried by a later call of the same warm machine, which joins, checks and
# unpacks both (join_core). A carried unsplit .gpu-bundle/core (an older bundle, or a smaller tree) is still
# unpacked in one go. run_h200_sglang.sh joins SGLang's wheel archive (scripts/device/make_sglang_bundle.sh: parts of
# <= 45 MiB, one a call) the same way (join_checked).
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# pytest over the repository's tests, dcp-triton from /tmp/dcp: tests/ is a package, and pytest's default import mode
# would put the repository root first on sys.path, where its dcp_plugin/ folder (the checkout's code) comes before the
# install; "append" leaves the root where PYTHONPATH has it, after /tmp/dcp.
PYTEST=(python3 -m pytest --import-mode=append -p no:cacheprovider)
VLLM_UNPACKED=/tmp/vs/.unpacked  # written once an unpack finished: a cut-short tar leaves /tmp/vs without it

vllm_unpacked() { test -f "$VLLM_UNPACKED"; }

# The benchmarks are the package benchmarks/ of the repository, run as modules (python3 -m benchmarks.kernels.x) from
# /tmp with the repository root last on PYTHONPATH: benchmarks come from the repository, dcp_plugin from the install
# before it (/tmp/dcp). The calls name a script by its path from the repository root, as the pages do.
module_of() {  # module_of SCRIPT.py: the module of a script named by its path from the repository root (or
  # absolute under it): benchmarks/vllm_e2e/vllm_hybrid_gpu.py -> benchmarks.vllm_e2e.vllm_hybrid_gpu
  local path=${1#"$repo"/}
  path=${path#./}
  [[ $path == *.py && $path != /* && $path != *..* ]] || { echo "not a script of the repository: $1" >&2; return 1; }
  path=${path%.py}
  echo "${path//\//.}"
}

script_argv() {  # script_argv SCRIPT.py [ARGS...]: sets ARGV, the command that runs a script named by its path from
  # the repository root: a benchmark (or a tool of scripts/) as its module (module_of), an example by its path, as a
  # user runs it (python3 examples/x.py: its folder first on the path, where its _shared.py is)
  local path=${1#"$repo"/} module
  shift
  path=${path#./}
  if [[ $path == examples/*.py && -f $repo/$path ]]; then ARGV=(python3 "$repo/$path" "$@"); return 0; fi
  module=$(module_of "$path") || return 1
  ARGV=(python3 -m "$module" "$@")
}

repo_last() {  # PYTHONPATH with the repository root last (added once): benchmarks importable, the install first
  case ":${PYTHONPATH:-}:" in
    *":$repo:"*) echo "$PYTHONPATH" ;;
    *) echo "${PYTHONPATH:+$PYTHONPATH:}$repo" ;;
  esac
}

untar_vllm() {  # untar_vllm ARCHIVE: into a fresh /tmp/vs, marked complete only when tar succeeded
  rm -rf /tmp/vs && mkdir -p /tmp/vs && tar xJf "$1" -C /tmp/vs && touch "$VLLM_UNPACKED"
}

install_dcp() {  # install_dcp LOG: dcp-triton into /tmp/dcp, fresh each call (a warm machine may hold an older one)
  local log=$1
  rm -rf /tmp/dcp
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/dcp "$repo" >"$log" 2>&1 \
    || { cat "$log"; return 1; }
}

unpack_core() {  # a carried .gpu-bundle/core: unpack it into /tmp/vs; a carried core-part: keep it in /tmp
  if test -f "$repo/.gpu-bundle/core/vllm026.tar.xz"; then
    untar_vllm "$repo/.gpu-bundle/core/vllm026.tar.xz"
  elif test -f "$repo/.gpu-bundle/core-part/vllm026.tar.xz.00"; then
    cp "$repo/.gpu-bundle/core-part/vllm026.tar.xz.00" /tmp/
  fi
}

core_status() {  # after unpack_core: what the unpack stage left in /tmp; 1 when neither core nor core-part came
  if vllm_unpacked; then echo "vLLM unpacked into /tmp/vs"
  elif test -f /tmp/vllm026.tar.xz.00; then
    echo "first part of vLLM's archive kept in /tmp: the next call carries .gpu-bundle/core-rest, which joins it"
  else echo "neither .gpu-bundle/core nor .gpu-bundle/core-part was carried" >&2; return 1; fi
}

join_core() {  # the split archive's rest, carried in core-rest, joined to the part an unpack call left in /tmp
  local rest=$repo/.gpu-bundle/core-rest
  if vllm_unpacked || ! test -f "$rest/vllm026.tar.xz.01"; then return 0; fi
  test -f /tmp/vllm026.tar.xz.00 || { echo "no /tmp/vllm026.tar.xz.00: first an unpack call carrying" \
    ".gpu-bundle/core-part (the machine must still be warm)" >&2; return 1; }
  join_checked /tmp/vllm026.tar.xz "$rest/SHA256SUMS" /tmp/vllm026.tar.xz.00 "$rest/vllm026.tar.xz.01" || return 1
  untar_vllm /tmp/vllm026.tar.xz && rm -f /tmp/vllm026.tar.xz /tmp/vllm026.tar.xz.00
}

join_checked() {  # join_checked FILE SUMS PART...: the parts, in order, into FILE; every file SUMS names, checked in
  # FILE's folder (the whole archive, and the parts where SUMS lists them)
  local out=$1 sums=$2
  shift 2
  cat "$@" >"$out" && (cd "$(dirname "$out")" && sha256sum -c --quiet "$sums")
}

from_repo() {  # pytest run from /tmp names files relative to /tmp (../<checkout>/tests/...): name them from the root
  local rel
  rel=$(realpath --relative-to=/tmp "$repo")
  sed -u "s#\(^\| \)$rel/#\1#g"
}

results_here() {  # the scripts run from /tmp: a relative --out benchmarks/results/x.json lands where pack_results looks
  mkdir -p /tmp/benchmarks && ln -sfn "$repo/benchmarks/results" /tmp/benchmarks/results
}

pack_results() {  # pack_results SINCE ARCHIVE: every file under benchmarks/results newer than SINCE, one tarball
  # (the device returns a limited number of files; copying every result file once lost a run's own): unpack it
  # into benchmarks/results/ on the host.
  (cd "$repo/benchmarks/results" && find . -type f -newer "$1" -print0 | tar czf "$2" --null -T -)
}
