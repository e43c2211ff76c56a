#!/usr/bin/env bash
# One command for a lent GPU, with no network: the GPU test tier, a short real tune of one
# problem, a subset of the attention sweep and the host-side figures. Every stage is
# time-boxed and logged on its own, a failed or timed-out stage never loses the others'
# results, and the whole run stays inside a global budget (default 420 s).
#
#   bash benchmarks/gpu_check.sh [--dry] [--budget SECONDS] [--tar FILE] OUTDIR
#   bash benchmarks/gpu_check.sh --fetch-wheels     # here, with network: fill .whl/ (py3.12)
#
# Writes OUTDIR/summary.tsv (stage, status, seconds, note), OUTDIR/logs/<stage>.log,
# OUTDIR/env.json, OUTDIR/gpu-tests.xml, OUTDIR/tuning.db, OUTDIR/sweep/attention.csv (+ png,
# env), OUTDIR/host.json, then packs OUTDIR into one tarball (--tar, default OUTDIR.tar.gz)
# and prints the stage summary and the sweep table last. Exit status: 0 when no stage
# failed or timed out, else 1.
#
# --dry (or FLASHTUNE_GPU_CHECK_DRY=1) skips the stages that need a GPU and runs only their
# plumbing: the tune command's options are checked, the sweep is planned (--plan-only).
# Without --dry, a machine where torch sees no GPU gets the same treatment, with 'skipped: no
# GPU' in the summary, plus a failed 'gpu' stage (exit status 1).
#
# Python: $FLASHTUNE_PYTHON if set, else ./.venv/bin/python if it imports torch, else python3.
# When .whl/ (or $GC_WHEEL_DIR) holds wheels, those made for this Python are installed (no
# index, no deps) into a private target dir first; the repository itself is put on
# PYTHONPATH, so nothing needs to be installed.
#
# On the lent H200 (carry .whl; results come back as one file):
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_check.sh --tar "$OUT/gpu_check.tar.gz" /tmp/gpu_check
#
# Sourcing this file defines the functions without running anything (used by the tests).

set -uo pipefail

GC_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The problem tuned for real, and the sweep subset that shows it next to the baselines.
GC_TUNE_ARGS=(--head-dim 128 --dtype bf16 --seqlens 4096 --trials 20)
GC_SWEEP_ARGS=(--subset --dtypes bf16 --head-dims 128 --repeats 20)
# Seconds kept back at the end for the summary and the tarball; shortest stage worth running.
GC_RESERVE_S=15
GC_MIN_STAGE_S=5
# The packages flashtune needs that the lent machine's image lacks (see --fetch-wheels).
GC_WHEELS=(optuna sqlalchemy alembic platformdirs colorlog mako)

gc_log() { printf '[gpu_check %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# gc_init OUTDIR BUDGET_S: start the clock and the summary.
gc_init() {
  GC_OUT="$1"
  GC_BUDGET_S="$2"
  GC_START=$(date +%s)
  mkdir -p "$GC_OUT/logs" || return 1
  GC_OUT="$(cd "$GC_OUT" && pwd)"
  GC_SUMMARY="$GC_OUT/summary.tsv"
  printf 'stage\tstatus\tseconds\tnote\n' >"$GC_SUMMARY"
}

# Seconds left for stages (the reserve excluded).
gc_remaining() {
  echo $((GC_BUDGET_S - ($(date +%s) - GC_START) - GC_RESERVE_S))
}

gc_inner() {  # CAP_S MARGIN_S: a tool's own budget inside a stage of up to CAP_S seconds
  local left
  left=$(gc_remaining)
  local limit=$(($1 < left ? $1 : left))
  echo $((limit - $2 > 10 ? limit - $2 : 10))
}

gc_record() {  # NAME STATUS SECONDS NOTE
  local note="${4//$'\t'/ }"
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${note//$'\n'/ }" >>"$GC_SUMMARY"
  gc_log "stage $1: $2 (${3}s)${4:+ - $note}"
}

gc_skip() {  # NAME REASON
  gc_record "$1" "skipped" 0 "$2"
}

gc_last_line() {  # the last non-blank line of FILE, ASCII only, at most 160 characters
  LC_ALL=C tr -c '[:print:]\n' ' ' <"$1" | tr -s ' ' | grep -v '^[[:space:]]*$' | tail -n 1 |
    cut -c1-160
}

# gc_stage NAME CAP_S CMD...: run CMD with a timeout of min(CAP_S, time left), output to
# logs/NAME.log; record passed, failed (exit N) or timed out. Never fails itself.
gc_stage() {
  local name="$1" cap="$2"
  shift 2
  local left
  left=$(gc_remaining)
  local limit=$((cap < left ? cap : left))
  if ((limit < GC_MIN_STAGE_S)); then
    gc_skip "$name" "no time left in the ${GC_BUDGET_S}s budget"
    return 0
  fi
  local log="$GC_OUT/logs/$name.log" t0 rc
  gc_log "stage $name: up to ${limit}s: $*"
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$log" 2>&1 </dev/null
  rc=$?
  local took=$(($(date +%s) - t0))
  case $rc in
    0) gc_record "$name" "passed" "$took" "" ;;
    124 | 137) gc_record "$name" "timed out" "$took" "killed after ${limit}s; see logs/$name.log" ;;
    *) gc_record "$name" "failed" "$took" "exit $rc; $(gc_last_line "$log")" ;;
  esac
  return 0
}

# Choose the interpreter and make flashtune (and carried wheels) importable.
gc_python() {
  if [[ -n "${GC_PY:-}" ]]; then
    :  # chosen by the parent run
  elif [[ -n "${FLASHTUNE_PYTHON:-}" ]]; then
    GC_PY="$FLASHTUNE_PYTHON"
  elif [[ -x "$GC_REPO/.venv/bin/python" ]] && "$GC_REPO/.venv/bin/python" -c 'import torch' \
      2>/dev/null; then
    GC_PY="$GC_REPO/.venv/bin/python"
  else
    GC_PY="python3"
  fi
  case ":${PYTHONPATH:-}:" in
    *":$GC_REPO:"*) ;;
    *) export PYTHONPATH="$GC_REPO${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
}

gc_install_wheels() {  # TARGET_DIR: install the usable .whl/*.whl there, check the imports
  local target="$1" wheels=()
  mapfile -t wheels < <("$GC_PY" - "${GC_WHEEL_DIR:-$GC_REPO/.whl}"/*.whl <<'PY'
import sys
from pathlib import Path
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:  # no way to check: offer them all
    print("\n".join(p for p in sys.argv[1:] if Path(p).is_file()))
    sys.exit(0)
supported = set(sys_tags())
for path in sys.argv[1:]:
    if not Path(path).is_file():
        continue
    name, version, _, tags = parse_wheel_filename(Path(path).name)
    if tags & supported:
        print(path)
    else:
        print(f"skipping {Path(path).name}: not for this Python", file=sys.stderr)
PY
  )
  if ((${#wheels[@]} == 0)); then
    echo "no usable wheels in ${GC_WHEEL_DIR:-.whl/}: using the interpreter's own packages"
  else
    "$GC_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$target" "${wheels[@]}" || return 1
    echo "installed ${#wheels[@]} wheel(s) into $target"
    export PYTHONPATH="$target:$PYTHONPATH"
  fi
  "$GC_PY" -c 'import torch, optuna, sqlalchemy, alembic, platformdirs, jinja2, typer, rich
import flashtune.cli
print("imports ok: torch", torch.__version__, "optuna", optuna.__version__,
      "sqlalchemy", sqlalchemy.__version__)'
}

gc_check_tune_options() {  # the options the GPU run gives `flashtune tune` must exist
  local help opt missing=()
  help=$(COLUMNS=200 TERM=dumb NO_COLOR=1 "$GC_PY" -m flashtune.cli tune --help 2>&1) || {
    echo "error: \`flashtune tune --help\` failed:"; echo "$help"; return 1; }
  for opt in "${GC_TUNE_ARGS[@]}" --timeout; do
    [[ "$opt" == --* ]] || continue
    grep -q -- "$opt" <<<"$help" || missing+=("$opt")
  done
  if ((${#missing[@]})); then
    echo "error: flashtune tune lacks option(s) ${missing[*]} that gpu_check.sh passes:"
    echo "$help"
    return 1
  fi
  echo "flashtune tune accepts: ${GC_TUNE_ARGS[*]} --timeout"
}

gc_has_gpu() {
  "$GC_PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1
}

gc_finish() {  # print the summary and the sweep table, pack OUTDIR; exit status
  local tarball="$1"
  echo
  echo "================ gpu_check summary ($(($(date +%s) - GC_START))s of ${GC_BUDGET_S}s) ================"
  column -t -s $'\t' "$GC_SUMMARY" 2>/dev/null || cat "$GC_SUMMARY"
  if [[ -f "$GC_OUT/logs/tune.log" ]]; then
    echo "---- tune (last lines) ----"
    tail -n 12 "$GC_OUT/logs/tune.log"
  fi
  if [[ -f "$GC_OUT/logs/sweep.log" ]] && grep -q "attention forward" "$GC_OUT/logs/sweep.log"; then
    echo "---- sweep ----"
    sed -n '/attention forward/,$p' "$GC_OUT/logs/sweep.log"
  fi
  if [[ -f "$GC_OUT/logs/host.log" ]]; then
    echo "---- host ----"
    tail -n 14 "$GC_OUT/logs/host.log"
  fi
  if [[ -n "$tarball" ]]; then
    mkdir -p "$(dirname "$tarball")"
    tar -czf "$tarball" -C "$(dirname "$GC_OUT")" "$(basename "$GC_OUT")" &&
      echo "packed $GC_OUT -> $tarball ($(du -h "$tarball" | cut -f1))"
  fi
  if awk -F'\t' 'NR > 1 && ($2 == "failed" || $2 == "timed out") {bad = 1} END {exit !bad}' \
      "$GC_SUMMARY"; then
    return 1
  fi
  return 0
}

gc_fetch_wheels() {
  local py="${FLASHTUNE_PYTHON:-$GC_REPO/.venv/bin/python}" pins=() name version
  for name in "${GC_WHEELS[@]}"; do
    version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
      "$name") || { echo "error: $name is not installed in $py; install flashtune first" >&2; return 1; }
    pins+=("$name==$version")
  done
  local dir="${GC_WHEEL_DIR:-$GC_REPO/.whl}"
  mkdir -p "$dir"
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "${pins[@]}"
}

gc_main() {
  local dry="${FLASHTUNE_GPU_CHECK_DRY:-0}" budget=420 tarball="" out=""
  while (($#)); do
    case "$1" in
      --dry) dry=1 ;;
      --budget) budget="$2"; shift ;;
      --tar) tarball="$2"; shift ;;
      --fetch-wheels) gc_fetch_wheels; return $? ;;
      --internal-install-wheels) gc_python; gc_install_wheels "$2"; return $? ;;
      --internal-check-tune-options) gc_python; gc_check_tune_options; return $? ;;
      -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        return 0 ;;
      -*) echo "error: unknown option $1 (see --help)" >&2; return 2 ;;
      *) out="$1" ;;
    esac
    shift
  done
  if [[ -z "$out" ]]; then
    echo "error: OUTDIR is missing; usage: gpu_check.sh [--dry] [--budget S] [--tar FILE] OUTDIR" >&2
    return 2
  fi
  if ! [[ "$budget" =~ ^[0-9]+$ ]] || ((budget < 30)); then
    echo "error: --budget $budget must be a whole number of seconds >= 30" >&2
    return 2
  fi
  [[ "$dry" == 1 || "$dry" == true ]] && dry=1 || dry=0
  export PYTHONUNBUFFERED=1
  gc_init "$out" "$budget" || { echo "error: cannot create $out" >&2; return 2; }
  [[ -z "$tarball" ]] && tarball="$GC_OUT.tar.gz"
  gc_python

  # Private state: the tuning DB is a result (kept); compiled kernels are not (kept out).
  export FLASHTUNE_DB="sqlite:///$GC_OUT/tuning.db"
  # Scratch (carried wheels, compiled kernels) lives outside OUTDIR and goes at the end.
  GC_TMP="$(mktemp -d /tmp/flashtune-gpu-check.XXXXXX)"
  trap 'rm -rf "$GC_TMP"' EXIT
  export FLASHTUNE_CACHE_DIR="${FLASHTUNE_CACHE_DIR:-$GC_TMP/cache}"
  if [[ -z "${FLASHTUNE_CUDA_HOME:-}" && -d /usr/local/cuda/include ]]; then
    export FLASHTUNE_CUDA_HOME=/usr/local/cuda
  fi

  local site="$GC_TMP/site" self
  mkdir -p "$site"
  self=(bash "$GC_REPO/benchmarks/gpu_check.sh")
  export GC_PY
  gc_stage install 90 "${self[@]}" --internal-install-wheels "$site"
  [[ -n "$(ls -A "$site")" ]] && export PYTHONPATH="$site:$PYTHONPATH"
  gc_stage env 45 "$GC_PY" "$GC_REPO/benchmarks/_common.py" --env-json "$GC_OUT/env.json"
  command -v nvidia-smi >/dev/null && nvidia-smi >"$GC_OUT/logs/nvidia-smi.log" 2>&1

  local gpu=0
  if ((dry == 0)) && gc_has_gpu; then gpu=1; fi
  local why="skipped: no GPU"
  ((dry)) && why="skipped: dry run"

  if ((gpu)); then
    # The tests keep their own database (never the results'); a hung test or a module that
    # fails to import fails alone.
    gc_stage gpu-tests 150 env -u FLASHTUNE_DB "$GC_PY" -m pytest -m gpu -q -p no:cacheprovider \
      -o timeout=60 --continue-on-collection-errors --junitxml="$GC_OUT/gpu-tests.xml" \
      "$GC_REPO/tests"
    # Each tool gets its own budget inside its stage's, so it stops cleanly and reports.
    gc_stage tune 120 "$GC_PY" -m flashtune.cli tune "${GC_TUNE_ARGS[@]}" \
      --timeout "$(gc_inner 120 30)"
    gc_stage sweep 150 "$GC_PY" "$GC_REPO/benchmarks/attention.py" "${GC_SWEEP_ARGS[@]}" \
      --out "$GC_OUT/sweep" --time-budget "$(gc_inner 150 40)"
    gc_stage host 60 "$GC_PY" "$GC_REPO/benchmarks/host.py" --short --json "$GC_OUT/host.json"
  else
    if ((dry == 0)); then
      gc_record gpu "failed" 0 "torch sees no CUDA GPU (see logs/env.log); use --dry for a plumbing check"
    fi
    gc_skip gpu-tests "$why"
    # Plumbing: the options the GPU run passes must exist; the sweep must plan.
    gc_stage tune-options 60 "${self[@]}" --internal-check-tune-options
    gc_stage sweep-plan 60 "$GC_PY" "$GC_REPO/benchmarks/attention.py" "${GC_SWEEP_ARGS[@]}" \
      --out "$GC_OUT/sweep" --plan-only
    gc_skip tune "$why"
    gc_skip sweep "$why"
    gc_skip host "$why (host.py runs in CI)"
  fi
  gc_finish "$tarball"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  gc_main "$@"
  exit $?
fi
