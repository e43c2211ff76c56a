#!/usr/bin/env bash
# NVRTC compatibility: compile every default kernel of every family with one CUDA release's
# NVRTC and nothing but that release's runtime headers (no nvidia-cuda-crt or
# nvidia-cuda-cccl header wheels), found by flashtune itself: the toolchain the lent GPU's
# image has (nvidia-cuda-nvrtc and nvidia-cuda-runtime of CUDA 13.0).
#
#   bash benchmarks/nvrtc13_compat.sh [--cuda 13.0] [--venv DIR] [--fresh] [--arch ARCH]...
#
# Creates (or, when it already holds the right versions, reuses) a scratch virtual
# environment DIR (default ${TMPDIR:-/tmp}/flashtune-nvrtc-<release>) holding exactly
# nvidia-cuda-nvrtc==<release>.* and nvidia-cuda-runtime==<release>.* (about 230 MB from the
# package index), checks that it holds no other package, then runs
# benchmarks/toolchain_compat.py with the project's Python (as gpu_check.sh chooses it) and
# the scratch site-packages first on sys.path, for sm_80 and sm_90 unless --arch says
# otherwise. --fresh recreates DIR. Exit status: 0 when every kernel compiled, else that of
# the step that failed (2 for bad arguments).

set -uo pipefail

nc_main() {
  local release=13.0 venv="" fresh=0 archs=()
  while (($#)); do
    case "$1" in
      --cuda) release="$2"; shift ;;
      --venv) venv="$2"; shift ;;
      --fresh) fresh=1 ;;
      --arch) archs+=(--arch "$2"); shift ;;
      -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        return 0 ;;
      *) echo "error: unknown argument $1 (see --help)" >&2; return 2 ;;
    esac
    shift
  done
  if ! [[ "$release" =~ ^1[3-9]\.[0-9]+$ ]]; then
    echo "error: --cuda $release: expected a CUDA release of 13.0 or later, e.g. 13.0" >&2
    return 2
  fi
  venv="${venv:-${TMPDIR:-/tmp}/flashtune-nvrtc-$release}"
  local repo
  repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  # shellcheck source=benchmarks/gpu_check.sh
  source "$repo/benchmarks/gpu_check.sh"  # defines gc_python (the project's interpreter)
  gc_python
  local pins=("nvidia-cuda-nvrtc==$release.*" "nvidia-cuda-runtime==$release.*")

  # The scratch environment: exactly the two wheels (pip, setuptools aside).
  local check_env
  check_env=$(cat <<'PY'
import importlib.metadata as md, sys
release = sys.argv[1]
wanted = {"nvidia-cuda-nvrtc", "nvidia-cuda-runtime"}
tools = {"pip", "setuptools", "wheel"}
found = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
bad = [f"{n} {v}" for n, v in found.items() if n not in wanted | tools]
bad += [f"{n} {found[n]} (not {release}.*)" for n in wanted & set(found)
        if not found[n].startswith(release + ".")]
bad += [f"{n} missing" for n in wanted - set(found)]
print(", ".join(f"{n} {found[n]}" for n in sorted(wanted & set(found))))
sys.exit(f"the scratch environment is not exactly {sorted(wanted)} {release}.*: {bad}"
         if bad else 0)
PY
  )
  if ((fresh)) || ! [[ -x "$venv/bin/python" ]] ||
      ! "$venv/bin/python" -c "$check_env" "$release" >/dev/null 2>&1; then
    echo "creating $venv with ${pins[*]}"
    rm -rf "$venv"
    "$GC_PY" -m venv "$venv" || return
    timeout 900 "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      --only-binary=:all: "${pins[@]}" || return
  fi
  local installed
  installed=$("$venv/bin/python" -c "$check_env" "$release") || return
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') || return
  echo "scratch environment $venv: $installed"
  echo "CUDA headers there: $(ls "$site/nvidia/cu13/include" | wc -l) files; crt/: $(
    [[ -d "$site/nvidia/cu13/include/crt" ]] && echo present || echo absent); cccl/: $(
    [[ -d "$site/nvidia/cu13/include/cccl" ]] && echo present || echo absent)"

  # flashtune finds the toolchain by itself: the scratch site first on sys.path, no
  # FLASHTUNE_CUDA_HOME; the check fails unless that is what it found.
  PYTHONPATH="$site:$PYTHONPATH" timeout 1800 env -u FLASHTUNE_CUDA_HOME \
    "$GC_PY" "$repo/benchmarks/toolchain_compat.py" --expect-nvrtc "$release" \
    --expect-under "$site" "${archs[@]}"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  nc_main "$@"
  exit $?
fi
