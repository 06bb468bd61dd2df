# Sourced by the device-call scripts (multi_gpu_run.sh, new_families_run.sh): `run NAME SECONDS COMMAND...`
# runs one step under its own time limit, its output in $OUT/NAME.log, and appends "NAME rc=... Ns" to
# $OUT/steps.txt, so that a slow step leaves the others' results.
mkdir -p "$OUT"
run() {
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s" | tee -a "$OUT/steps.txt"
}
