# Sourced by scripts/test.sh and scripts/main-job.sh. `heartbeat LABEL CMD ARGS...` runs the
# command with its output (stdout and stderr, merged into stdout) passed on a line at a time,
# and after every HEARTBEAT_SECONDS (9) without a line prints `... LABEL: working, N s` on
# its own (9 s: a line at least every 10 s, scheduling delays included), so that a log never
# goes silent for minutes (a long compile, a kernel booting in QEMU). Returns the command's
# exit status.
#
# On a terminal, commands draw their own progress bars (cargo, legendctl train) and a pipe would
# hide them: the command then runs as it is, unless HEARTBEAT=always.
heartbeat() {
  local label=$1
  shift
  if [ -t 1 ] && [ "${HEARTBEAT:-}" != always ]; then
    "$@"
    return
  fi
  local every=${HEARTBEAT_SECONDS:-9} start=$SECONDS
  "$@" 2>&1 | {
    local line status
    while :; do
      if IFS= read -r -t "$every" line; then
        printf '%s\n' "$line"
      else
        status=$?
        # More than 128: the wait timed out (a partial line is kept in `line`).
        if [ "$status" -gt 128 ]; then
          [ -n "$line" ] && printf '%s\n' "$line"
          printf '... %s: working, %d s\n' "$label" "$((SECONDS - start))"
        else
          [ -n "$line" ] && printf '%s\n' "$line"
          break
        fi
      fi
    done
  }
  return "${PIPESTATUS[0]}"
}
