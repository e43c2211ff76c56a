#!/usr/bin/env bash
# One command for a lent GPU, with no network: install the carried wheels; a canary first
# (each arch-specific kernel's first-use check in its own process with a timeout, results
# recorded so no later stage checks again; if one fails or hangs, every later stage runs with
# FLASHTUNE_ARCH_SPECIFIC=0 and the summary says so); the serving forward at full-chip shapes
# against SDPA's flash and cuDNN backends (benchmarks/serving_fwd.py); a smoke run (one
# kernel per family compiled, launched, checked against torch and timed against SDPA's flash
# backend), then the GPU test tier (the Hopper tests first), a short real tune, a subset of
# the attention sweep and the host-side figures. Most valuable first: every stage and every
# external command is time-limited, a failed or timed-out stage never loses the others'
# results, and the whole run stays inside a global budget (default 780 s, the install
# included, so that a 15-minute device allowance keeps two minutes for the machine's start
# and the transfers). The stage plan with its caps is printed first (--plan prints only that).
#
#   bash benchmarks/gpu_check.sh [--dry] [--budget SECONDS] [--tar FILE] OUTDIR
#   bash benchmarks/gpu_check.sh --plan [--budget SECONDS]
#   bash benchmarks/gpu_check.sh --fetch-wheels      # here, with network: fill .whl/
#
# --fetch-wheels works from a fresh clone (python3 with pip, nothing installed): it runs
# benchmarks/gpu_wheels.py fetch, which computes the wheels the GPU image lacks from
# pyproject.toml and benchmarks/gpu_image_packages.txt, fetches them for the image's Python
# 3.12 into .whl/ (or $GC_WHEEL_DIR), replacing what was there, and refuses to go over
# 40 MiB (about 5.4 MiB today: optuna, sqlalchemy, alembic, platformdirs, colorlog, mako).
#
# Writes OUTDIR/summary.tsv (stage, status, seconds, note), OUTDIR/logs/<stage>.log,
# OUTDIR/env.json, OUTDIR/smoke.json, OUTDIR/gpu-tests.xml, OUTDIR/gpu-tests-tuner.xml,
# OUTDIR/tuning.db, OUTDIR/sweep/attention.csv (+ png, env), OUTDIR/host.json, then packs
# OUTDIR into one tarball (--tar, default OUTDIR.tar.gz) and prints the smoke lines, the
# stage summary and the sweep table last. Exit status: 0 when no stage failed or timed out,
# else 1 (2 for bad arguments).
#
# --dry (or FLASHTUNE_GPU_CHECK_DRY=1) runs, in place of each GPU stage, the part that needs
# no GPU: the smoke kernels are compiled for sm_90, `flashtune precompile` runs as on the GPU
# but on the head dim 64 bf16 defaults only, the GPU tests are collected, the options given
# to `flashtune tune` are checked, the sweep is planned.
# Without --dry, a machine where torch sees no GPU gets the same treatment, with 'skipped: no
# GPU' in the summary, plus a failed 'gpu' stage (exit status 1).
#
# Kernel families: the smoke stage prints one line per family registered in
# flashtune.families (benchmarks/gpu_smoke.py, SMOKE_CASES: the forward first, through
# flashtune.attention against SDPA; every other family through the launch seam against its
# float64 reference), so a family that lands is covered with no change here.
#
# Python: $FLASHTUNE_PYTHON if set, else ./.venv/bin/python if it imports torch, else python3.
# The wheels of .whl/ (or $GC_WHEEL_DIR) made for that Python are installed (no index, no
# deps) into a private target dir first; the repository itself is put on PYTHONPATH, so
# nothing needs to be installed.
#
# On the lent H200 (carry .whl; the results come back as one file):
#   PYTHONUNBUFFERED=1 bash benchmarks/gpu_check.sh --tar "$OUT/gpu_check.tar.gz" /tmp/gpu_check
#
# Sourcing this file defines the functions without running anything (used by the tests).

set -uo pipefail

GC_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GC_DEFAULT_BUDGET=780
# Seconds each arch-specific kernel's canary process may take (compile and check), and the
# first-use deadline of its check inside that.
GC_CANARY_KERNEL_S=${GC_CANARY_KERNEL_S:-40}
GC_CANARY_CHECK_S=${GC_CANARY_CHECK_S:-20}
# The stage plan: name|cap in seconds|what it does. The caps add up, with GC_RESERVE_S, to at
# most GC_DEFAULT_BUDGET, so every stage gets its whole cap in a full-length run.
GC_PLAN=(
  "install|30|install the carried wheels for this Python, check every requirement"
  "env|20|versions, the GPU and the NVRTC flashtune finds (env.json)"
  "nvidia-smi|10|the driver's view of the GPU"
  "canary|190|each sm_90a forward kernel's first-use check alone (${GC_CANARY_KERNEL_S}s each), then the backward's in one process (canary.log)"
  "serving|170|the serving forward at full-chip shapes vs sdpa-flash and sdpa-cudnn"
  "smoke|30|each family: one kernel compiled, launched, checked, timed vs SDPA flash"
  "backward|30|the training step (forward + backward, the sm_90a backward on cc 9.0) at 8k, causal d128 and d64, vs sdpa-flash"
  "gpu-tests|110|pytest -m gpu, the Hopper ones first, all but the tuner (gpu-tests.xml)"
  "gpu-tests-tuner|60|pytest -m gpu tests/tuner: a real tune the dispatcher serves"
  "precompile|35|every default kernel for the GPU's arch, compiled in parallel"
  "tune|30|flashtune tune of one problem (the results' tuning.db)"
  "sweep|20|a subset of the attention sweep against the baselines"
  "decode|20|a short decode sweep: GB/s and share of the copy peak, vs SDPA and flash-attn"
  "host|10|host-side figures (host.json)"
)
# The problem tuned for real, and the sweep subset that shows it next to the baselines.
GC_TUNE_ARGS=(--head-dim 128 --dtype bf16 --seqlens 4096 --trials 6)
GC_SWEEP_ARGS=(--subset --dtypes bf16 --head-dims 128 --repeats 20)
# The training step's line: batch 2 x 16 heads (d128; 32 at d64) at 8k, causal, fwd + bwd.
GC_BACKWARD_ARGS=(--passes fwdbwd --dtypes bf16 --head-dims 128,64 --causal causal
                  --seqlens 8192 --impls flashtune,sdpa-flash --warmup 2 --repeats 10)
GC_DECODE_ARGS=(--batches 1,64 --cache-lens 4096,65536 --groups 8 --page-sizes none,16,256
                --query-rows 1 --repeats 10)
# Seconds kept back at the end for the summary and the tarball; shortest stage worth running.
GC_RESERVE_S=15
GC_MIN_STAGE_S=5
# The arch the dry run compiles for (the lent GPU's), and the cap of each stage of a dry run
# (plumbing on a CPU machine, which may be slow and busy: not bound by the GPU plan).
GC_DRY_ARCH=sm_90
GC_DRY_CAP_S=600

gc_log() { printf '[gpu_check %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

gc_cap() {  # NAME: the stage's cap from GC_PLAN
  local entry
  for entry in "${GC_PLAN[@]}"; do
    [[ "${entry%%|*}" == "$1" ]] && { entry="${entry#*|}"; echo "${entry%%|*}"; return 0; }
  done
  echo "error: no stage $1 in GC_PLAN" >&2
  return 1
}

gc_plan_total() {  # the caps plus the reserve
  local entry total=$GC_RESERVE_S rest
  for entry in "${GC_PLAN[@]}"; do
    rest="${entry#*|}"
    total=$((total + ${rest%%|*}))
  done
  echo "$total"
}

gc_print_plan() {  # BUDGET_S
  local entry name rest
  echo "stage plan (caps in seconds; budget $1 s):"
  for entry in "${GC_PLAN[@]}"; do
    name="${entry%%|*}"
    rest="${entry#*|}"
    printf '  %-16s %4s  %s\n' "$name" "${rest%%|*}" "${rest#*|}"
  done
  printf '  %-16s %4s  %s\n' "(reserve)" "$GC_RESERVE_S" "summary and tarball"
  printf '  %-16s %4s\n' "total" "$(gc_plan_total)"
  if (($(gc_plan_total) > $1)); then
    echo "  note: the caps add up to more than the budget: the last stages get less or none"
  fi
  echo "  (a dry run replaces each GPU stage by its plumbing check, up to ${GC_DRY_CAP_S} s each)"
}

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
# logs/NAME.log; record passed, failed (exit N) or timed out. Never fails itself. At the
# limit CMD gets $GC_STAGE_SIGNAL (default TERM; INT lets pytest write its report), then
# KILL 10 s later.
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
  timeout --signal="${GC_STAGE_SIGNAL:-TERM}" --kill-after=10 "$limit" "$@" >"$log" 2>&1 </dev/null
  rc=$?
  local took=$(($(date +%s) - t0))
  case $rc in
    0) gc_record "$name" "passed" "$took" "" ;;
    124 | 137) gc_record "$name" "timed out" "$took" "killed after ${limit}s; see logs/$name.log" ;;
    *) gc_record "$name" "failed" "$took" "exit $rc; $(gc_last_line "$log")" ;;
  esac
  return 0
}

gc_planned() {  # NAME CMD...: gc_stage with NAME's cap from GC_PLAN
  local name="$1" cap
  shift
  cap=$(gc_cap "$name") || return 1
  gc_stage "$name" "$cap" "$@"
}

# Choose the interpreter and make flashtune (and carried wheels) importable.
gc_python() {
  if [[ -n "${GC_PY:-}" ]]; then
    :  # chosen by the parent run
  elif [[ -n "${FLASHTUNE_PYTHON:-}" ]]; then
    GC_PY="$FLASHTUNE_PYTHON"
  elif [[ -x "$GC_REPO/.venv/bin/python" ]] &&
      timeout 60 "$GC_REPO/.venv/bin/python" -c 'import torch' 2>/dev/null; then
    GC_PY="$GC_REPO/.venv/bin/python"
  else
    GC_PY="python3"
  fi
  case ":${PYTHONPATH:-}:" in
    *":$GC_REPO:"*) ;;
    *) export PYTHONPATH="$GC_REPO${PYTHONPATH:+:$PYTHONPATH}" ;;
  esac
}

gc_install_wheels() {  # TARGET_DIR: install the usable wheels there, check the requirements
  local target="$1"
  "$GC_PY" "$GC_REPO/benchmarks/gpu_wheels.py" install --site "$target" \
    --wheels "${GC_WHEEL_DIR:-$GC_REPO/.whl}" || return 1
  PYTHONPATH="$target:$PYTHONPATH" "$GC_PY" -c '
import torch, optuna, sqlalchemy, alembic, platformdirs, jinja2, typer, rich
import flashtune.cli
print("imports ok: torch", torch.__version__, "optuna", optuna.__version__,
      "sqlalchemy", sqlalchemy.__version__)'
}

gc_check_options() {  # SUBCOMMAND ARGS...: the options the GPU run gives `flashtune SUB`
  local sub="$1" help opt missing=()
  shift
  help=$(COLUMNS=200 TERM=dumb NO_COLOR=1 "$GC_PY" -m flashtune.cli "$sub" --help 2>&1) || {
    echo "error: \`flashtune $sub --help\` failed:"; echo "$help"; return 1; }
  for opt in "$@"; do
    [[ "$opt" == --* ]] || continue
    grep -q -- "$opt" <<<"$help" || missing+=("$opt")
  done
  if ((${#missing[@]})); then
    echo "error: flashtune $sub lacks option(s) ${missing[*]} that gpu_check.sh passes:"
    echo "$help"
    return 1
  fi
  echo "flashtune $sub accepts: $*"
}

# A cc 9.0 GPU runs the sm_90a families by default: precompiling for sm_90a builds them and
# the portable kernels it falls back to.
gc_precompile_arch() {
  if [[ "$1" == "sm_90" ]]; then echo "sm_90a"; else echo "$1"; fi
}

gc_precompile_dir() {  # outside OUTDIR, so the kernels do not swell the tarball
  echo "${TMPDIR:-/tmp}/flashtune-gpu-check-precompiled"
}

gc_gpu_arch() {  # the GPU's arch (sm_XY) from env.json, else a time-limited probe; "" if none
  local env="$GC_OUT/env.json"
  if [[ -f "$env" ]]; then
    timeout 20 "$GC_PY" - "$env" <<'PY' 2>/dev/null
import json, sys
cap = json.load(open(sys.argv[1])).get("gpu_capability")
print("sm_" + cap.replace(".", "") if cap else "")
PY
  else
    timeout 60 "$GC_PY" -c 'import torch
if torch.cuda.is_available():
    print("sm_%d%d" % torch.cuda.get_device_capability())' 2>/dev/null
  fi
}

gc_show_smoke() {  # the smoke lines so far, as soon as the stage is over
  local log="$GC_OUT/logs/$1.log"
  [[ -f "$log" ]] && grep -E '^(smoke |error)' "$log" | sed 's/^/  /'
  return 0
}

gc_finish() {  # print the smoke lines, the summary and the sweep table, pack OUTDIR
  local tarball="$1" name
  echo
  for name in smoke smoke-compile; do
    if [[ -f "$GC_OUT/logs/$name.log" ]]; then
      echo "---- $name ----"
      gc_show_smoke "$name"
    fi
  done
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
  if [[ -f "$GC_OUT/logs/canary.log" ]]; then
    echo "---- canary ----"
    grep -E '^canary ' "$GC_OUT/logs/canary.log" | sed 's/^/  /'
  fi
  if [[ -f "$GC_OUT/logs/serving.log" ]] && grep -q "serving forward, TFLOP/s" "$GC_OUT/logs/serving.log"; then
    echo "---- serving forward (TFLOP/s; ratio to sdpa-flash / sdpa-cudnn) ----"
    sed -n '/serving forward, TFLOP\/s/,$p' "$GC_OUT/logs/serving.log"
  fi
  echo "================ gpu_check summary ($(($(date +%s) - GC_START))s of ${GC_BUDGET_S}s) ================"
  timeout 10 column -t -s $'\t' "$GC_SUMMARY" 2>/dev/null || cat "$GC_SUMMARY"
  if [[ -n "$tarball" ]]; then
    mkdir -p "$(dirname "$tarball")"
    timeout 60 tar -czf "$tarball" -C "$(dirname "$GC_OUT")" "$(basename "$GC_OUT")" &&
      echo "packed $GC_OUT -> $tarball ($(du -h "$tarball" | cut -f1))"
  fi
  if awk -F'\t' 'NR > 1 && ($2 == "failed" || $2 == "timed out") {bad = 1} END {exit !bad}' \
      "$GC_SUMMARY"; then
    return 1
  fi
  return 0
}

gc_fetch_wheels() {  # with network, from a fresh clone: python3 and pip are enough
  "${FLASHTUNE_PYTHON:-python3}" "$GC_REPO/benchmarks/gpu_wheels.py" fetch \
    --dest "${GC_WHEEL_DIR:-$GC_REPO/.whl}"
}

# gc_canary STATUS_FILE: the arch-specific kernels the runtime would serve, compiled in one
# process (nothing launched), then each one's first-use check in a process of its own under
# GC_CANARY_KERNEL_S (a hung kernel costs its own process only; results are recorded in the
# kernel cache, so later stages do not check again). Writes "ok" or "failed: WHAT" to
# STATUS_FILE; fails when a kernel fails, hangs or times out.
gc_canary() {
  local status="$1" entries entry rc bad=()
  echo "failed: the canary did not finish" >"$status"
  entries=$("$GC_PY" -m flashtune.cli check --gpu --list) || {
    echo "failed: cannot list the arch-specific kernels" >"$status"; return 1; }
  echo "arch-specific kernels: $(wc -w <<<"$entries")"
  [[ -z "$entries" ]] && { echo "ok" >"$status"; return 0; }
  "$GC_PY" -m flashtune.cli check --gpu --compile-only || {
    echo "failed: an arch-specific kernel does not compile" >"$status"; return 1; }
  # The forward's kernels one process each; the backward's (their entries name bwd) in one
  # process, whose cap grows by a check's deadline per kernel (a hang stops it, named).
  local forward=() backward=() group
  for entry in $entries; do
    if [[ "$entry" == *_bwd* ]]; then backward+=("$entry"); else forward+=("$entry"); fi
  done
  local groups=("${forward[@]}")
  ((${#backward[@]})) && groups+=("${backward[*]}")
  for group in "${groups[@]}"; do
    local only=() cap=$GC_CANARY_KERNEL_S name
    for entry in $group; do only+=(--only "$entry"); done
    ((${#only[@]} > 2)) && cap=$((GC_CANARY_KERNEL_S + (${#only[@]} / 2 - 1) * GC_CANARY_CHECK_S / 4))
    name=$group
    ((${#only[@]} > 2)) && name="the backward's $((${#only[@]} / 2)) kernels"
    timeout --kill-after=5 "$cap" "$GC_PY" -m flashtune.cli check --gpu "${only[@]}" \
      --timeout "$GC_CANARY_CHECK_S"
    rc=$?
    case $rc in
      0) echo "canary $name: pass" ;;
      124 | 137) echo "canary $name: killed after ${cap}s"
        bad+=("$name (killed after ${cap}s)") ;;
      2) echo "canary $name: HUNG"; bad+=("$name (hung)") ;;
      *) echo "canary $name: FAILED (exit $rc)"; bad+=("$name (exit $rc)") ;;
    esac
  done
  if ((${#bad[@]})); then
    echo "failed: ${bad[*]}" >"$status"
    return 1
  fi
  echo "ok" >"$status"
}

# After the canary: with anything but "ok" in STATUS_FILE, every later stage runs with
# FLASHTUNE_ARCH_SPECIFIC=0 (the portable kernels), and the summary says so.
gc_after_canary() {
  local said
  said=$(cat "$1" 2>/dev/null || echo "failed: no canary status")
  if [[ "$said" != ok ]]; then
    export FLASHTUNE_ARCH_SPECIFIC=0
    gc_record arch-specific "off" 0 "canary $said: later stages run with FLASHTUNE_ARCH_SPECIFIC=0"
  fi
}

# The GPU tests: one process (-n 0: the default run's xdist workers would share the GPU and
# its timings), each outcome in the log as it ends; a hung test or a module that fails to
# import fails alone. At a stage's cap they get SIGINT (GC_STAGE_SIGNAL=INT; timeout hands
# it on even to a run started with SIGINT ignored), so pytest stops and writes its report.
GC_GPU_TEST_OPTS=(-m gpu -n 0 -v -p no:cacheprovider -o timeout=60 --durations=10
  --continue-on-collection-errors)
# Collected first (pytest drops the duplicates among the files that follow).
GC_GPU_TESTS_FIRST=("$GC_REPO/tests/families/test_hopper_ws.py"
  "$GC_REPO/tests/families/test_hopper_gpu.py" "$GC_REPO/tests/api/test_api_gpu.py")

# The test files that hold GPU tests, those outside tests/tuner or (--tuner) inside it: the
# files that write the gpu mark (tests/conftest.py fails a run where a gpu test's file does
# not), so pytest imports a dozen modules instead of the whole tree (about 30 s of CPU).
gc_gpu_test_files() {
  local f
  grep -rl --include='test_*.py' -e 'pytest.mark.gpu' "$GC_REPO/tests" | sort |
    while read -r f; do
      case "$f" in
        "$GC_REPO/tests/tuner/"*) [[ "${1:-}" == --tuner ]] && echo "$f" ;;
        *) [[ "${1:-}" == --tuner ]] || echo "$f" ;;
      esac
    done
  return 0
}

gc_main() {
  local dry="${FLASHTUNE_GPU_CHECK_DRY:-0}" budget=$GC_DEFAULT_BUDGET tarball="" out=""
  local plan_only=0
  while (($#)); do
    case "$1" in
      --dry) dry=1 ;;
      --plan) plan_only=1 ;;
      --budget) budget="${2:-}"; shift ;;
      --tar) tarball="${2:-}"; shift ;;
      --fetch-wheels) gc_fetch_wheels; return $? ;;
      --internal-install-wheels) gc_python; gc_install_wheels "$2"; return $? ;;
      --internal-check-options) shift; gc_python; gc_check_options "$@"; return $? ;;
      --internal-canary) gc_python; gc_canary "$2"; return $? ;;
      -h | --help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        return 0 ;;
      -*) echo "error: unknown option $1 (see --help)" >&2; return 2 ;;
      *) out="$1" ;;
    esac
    shift
  done
  if ! [[ "$budget" =~ ^[0-9]+$ ]] || ((budget < 30)); then
    echo "error: --budget $budget must be a whole number of seconds >= 30" >&2
    return 2
  fi
  if ((plan_only)); then
    gc_print_plan "$budget"
    return 0
  fi
  if [[ -z "$out" ]]; then
    echo "error: OUTDIR is missing; usage: gpu_check.sh [--dry] [--budget S] [--tar FILE] OUTDIR" >&2
    return 2
  fi
  [[ "$dry" == 1 || "$dry" == true ]] && dry=1 || dry=0
  export PYTHONUNBUFFERED=1
  gc_init "$out" "$budget" || { echo "error: cannot create $out" >&2; return 2; }
  [[ -z "$tarball" ]] && tarball="$GC_OUT.tar.gz"
  gc_print_plan "$budget"
  gc_python

  # Private state: the tuning DB is a result (kept); compiled kernels are not (kept out).
  export FLASHTUNE_DB="sqlite:///$GC_OUT/tuning.db"
  # Scratch (carried wheels, compiled kernels) lives outside OUTDIR and goes at the end.
  GC_TMP="$(mktemp -d /tmp/flashtune-gpu-check.XXXXXX)"
  trap 'rm -rf "$GC_TMP"' EXIT
  export FLASHTUNE_CACHE_DIR="${FLASHTUNE_CACHE_DIR:-$GC_TMP/cache}"

  local site="$GC_TMP/site" self gpu_files tuner_files
  mapfile -t gpu_files < <(gc_gpu_test_files)
  mapfile -t tuner_files < <(gc_gpu_test_files --tuner)
  mkdir -p "$site"
  self=(bash "$GC_REPO/benchmarks/gpu_check.sh")
  export GC_PY
  gc_planned install "${self[@]}" --internal-install-wheels "$site"
  [[ -n "$(ls -A "$site")" ]] && export PYTHONPATH="$site:$PYTHONPATH"
  gc_planned env "$GC_PY" "$GC_REPO/benchmarks/_common.py" --env-json "$GC_OUT/env.json"
  if command -v nvidia-smi >/dev/null; then
    gc_planned nvidia-smi nvidia-smi
  else
    gc_skip nvidia-smi "nvidia-smi is not on the PATH"
  fi

  local arch=""
  ((dry == 0)) && arch=$(gc_gpu_arch)
  local why="skipped: no GPU"
  ((dry)) && why="skipped: dry run"
  local tune_opts=("${GC_TUNE_ARGS[@]}" --budget)
  local smoke=(--json "$GC_OUT/smoke.json" --budget "$(($(gc_cap smoke) - 5))")

  if [[ -n "$arch" ]]; then
    gc_planned canary "${self[@]}" --internal-canary "$GC_OUT/canary.status"
    gc_after_canary "$GC_OUT/canary.status"
    gc_planned serving "$GC_PY" "$GC_REPO/benchmarks/serving_fwd.py" --out "$GC_OUT/serving" \
      --time-budget "$(gc_inner "$(gc_cap serving)" 20)"
    gc_planned smoke "$GC_PY" "$GC_REPO/benchmarks/gpu_smoke.py" "${smoke[@]}"
    gc_show_smoke smoke
    gc_planned backward "$GC_PY" "$GC_REPO/benchmarks/attention.py" "${GC_BACKWARD_ARGS[@]}" \
      --out "$GC_OUT/backward" --time-budget "$(gc_inner "$(gc_cap backward)" 5)"
    # The tests keep their own database (never the results'); the tuner's test runs in a
    # stage of its own, so the others' cap cannot take it. The Hopper tests come first.
    GC_STAGE_SIGNAL=INT gc_planned gpu-tests env -u FLASHTUNE_DB "$GC_PY" -m pytest \
      "${GC_GPU_TEST_OPTS[@]}" --junitxml="$GC_OUT/gpu-tests.xml" "${GC_GPU_TESTS_FIRST[@]}" \
      "${gpu_files[@]}"
    GC_STAGE_SIGNAL=INT gc_planned gpu-tests-tuner env -u FLASHTUNE_DB "$GC_PY" -m pytest \
      "${GC_GPU_TEST_OPTS[@]}" --junitxml="$GC_OUT/gpu-tests-tuner.xml" \
      "${tuner_files[@]}"
    gc_planned precompile "$GC_PY" -m flashtune.cli precompile \
      --arch "$(gc_precompile_arch "$arch")" --all-defaults --out "$(gc_precompile_dir)"
    # Each tool gets its own budget inside its stage's, so it stops cleanly and reports.
    gc_planned tune "$GC_PY" -m flashtune.cli tune "${GC_TUNE_ARGS[@]}" \
      --budget "$(gc_inner "$(gc_cap tune)" 15)"
    gc_planned sweep "$GC_PY" "$GC_REPO/benchmarks/attention.py" "${GC_SWEEP_ARGS[@]}" \
      --out "$GC_OUT/sweep" --time-budget "$(gc_inner "$(gc_cap sweep)" 15)"
    gc_planned decode "$GC_PY" "$GC_REPO/benchmarks/decode.py" "${GC_DECODE_ARGS[@]}" \
      --out "$GC_OUT/decode" --time-budget "$(gc_inner "$(gc_cap decode)" 5)"
    gc_planned host "$GC_PY" "$GC_REPO/benchmarks/host.py" --short --json "$GC_OUT/host.json"
  else
    if ((dry == 0)); then
      gc_record gpu "failed" 0 "torch sees no CUDA GPU (see logs/env.log); use --dry for a plumbing check"
    fi
    # Plumbing: the smoke kernels compile, the GPU tests collect, the options the GPU run
    # passes exist, the sweep plans.
    local cap=$GC_DRY_CAP_S
    # The canary's kernels, as the emulator's virtual sm_90a lists them; the serving plan.
    gc_stage canary-list "$cap" env FLASHTUNE_BACKEND=emulator FLASHTUNE_EMULATOR_ARCH=sm_90a \
      "$GC_PY" -m flashtune.cli check --gpu --list
    gc_skip canary "$why"
    gc_stage serving-plan "$cap" "$GC_PY" "$GC_REPO/benchmarks/serving_fwd.py" --plan-only
    gc_skip serving "$why"
    gc_stage smoke-compile "$cap" "$GC_PY" "$GC_REPO/benchmarks/gpu_smoke.py" --dry \
      --arch "$GC_DRY_ARCH"
    gc_show_smoke smoke-compile
    gc_skip smoke "$why"
    gc_stage backward-plan "$cap" "$GC_PY" "$GC_REPO/benchmarks/attention.py" \
      "${GC_BACKWARD_ARGS[@]}" --out "$GC_OUT/backward" --plan-only
    gc_skip backward "$why"
    # The GPU run's command on the head dim 64 bf16 defaults only (a few kernels).
    gc_stage precompile-d64 "$cap" "$GC_PY" -m flashtune.cli precompile \
      --arch "$(gc_precompile_arch "$GC_DRY_ARCH")" --all-defaults --head-dim 64 \
      --dtype bf16 --out "$(gc_precompile_dir)"
    gc_skip precompile "$why"
    gc_stage gpu-tests-collect "$cap" env -u FLASHTUNE_DB "$GC_PY" -m pytest -m gpu -n 0 \
      --collect-only -q -p no:cacheprovider "${gpu_files[@]}" "${tuner_files[@]}"
    gc_skip gpu-tests "$why"
    gc_skip gpu-tests-tuner "$why"
    gc_stage tune-options "$cap" "${self[@]}" --internal-check-options tune "${tune_opts[@]}"
    gc_skip tune "$why"
    gc_stage sweep-plan "$cap" "$GC_PY" "$GC_REPO/benchmarks/attention.py" \
      "${GC_SWEEP_ARGS[@]}" --out "$GC_OUT/sweep" --plan-only
    gc_skip sweep "$why"
    gc_stage decode-plan "$cap" "$GC_PY" "$GC_REPO/benchmarks/decode.py" \
      "${GC_DECODE_ARGS[@]}" --out "$GC_OUT/decode" --dry
    gc_skip decode "$why"
    gc_skip host "$why (host.py runs in CI)"
  fi
  gc_finish "$tarball"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  gc_main "$@"
  exit $?
fi
