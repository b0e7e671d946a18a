#!/usr/bin/env bash
# What the access log costs: palisade with `[access_log] format = "json"` writing to a file
# vs the same build and config without it, interleaved in one run, median of several rounds.
#
# Method
# - Same setup as benches/load.sh: an nginx upstream answering `200 ok` from memory, palisade
#   release build with 1 worker thread, a guarded route, every request `x-fencing-token: 5`.
# - Two palisade processes run side by side, identical but for the [access_log] table; both
#   are pinned to core 0 (the access log's writer thread too, so its CPU counts), wrk and the
#   upstream to core 1. Only one of them is under load at a time.
# - Each round measures both, in alternating order (off, on, then on, off, ...) so that drift
#   on a shared machine does not favour one; DURATION seconds each after a 2 s warm-up. The
#   result is the median requests/s of each over ROUNDS rounds and their ratio (on / off),
#   and the median of the rounds' own ratios (each pair ran back to back, so this one is the
#   least disturbed by other load on the machine).
# - At the end: the access log's line count against the requests palisade answered, and the
#   dropped-lines counter (should be 0: the writer kept up).
#
# Usage: benches/access_log.sh      (ROUNDS=6 DURATION=5 CONNS="64" by default)
# Needs nginx and wrk (installed with apt-get when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-6}
CONNS=${CONNS:-64}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --bin palisade
BIN=${BIN:-target/release/palisade}

work_dir

UP=$(free_port); OFF=$(free_port); OFF_ADM=$(free_port); ON=$(free_port); ON_ADM=$(free_port)

upstream_conf "$WORK/upstream.conf" "$UP"
palisade_conf "$WORK/off/palisade.toml" "$OFF" "$OFF_ADM" "$UP"
palisade_conf "$WORK/on/palisade.toml" "$ON" "$ON_ADM" "$UP" http1 $'[access_log]\nformat = "json"\npath = "access.log"'

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/off/palisade.toml" 2>"$WORK/off.log" & PIDS+=($!)
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/on/palisade.toml" 2>"$WORK/on.log" & PIDS+=($!)
wait_port "$UP"; wait_port "$OFF"; wait_port "$ON"

run_wrk() { # port conns -> rps
  local out
  "${LOAD_CPU[@]}" wrk -t1 -c"$2" -d2s -H 'x-fencing-token: 5' "http://127.0.0.1:$1/orders/7" >/dev/null
  out=$("${LOAD_CPU[@]}" wrk -t1 -c"$2" -d"${DURATION}s" -H 'x-fencing-token: 5' "http://127.0.0.1:$1/orders/7")
  if grep -q "Non-2xx" <<<"$out"; then echo "non-2xx responses:" >&2; echo "$out" >&2; exit 1; fi
  awk '/^Requests\/sec:/ {print $2}' <<<"$out"
}
metric() { # admin-port series
  exec 3<>"/dev/tcp/127.0.0.1/$1"; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  awk -v s="$2" 'index($0, s" ") == 1 {print $2}' <&3; exec 3>&-
}

echo "access log cost: $(nproc) cores, $PIN, wrk -t1, ${DURATION}s x $ROUNDS rounds, json to a file"
for c in $CONNS; do
  offs=(); ons=(); ratios=()
  printf "%-6s | %-5s | %12s | %12s | %s\n" conns round "off rps" "on rps" "on/off"
  for r in $(seq "$ROUNDS"); do
    if ((r % 2)); then off=$(run_wrk "$OFF" "$c"); on=$(run_wrk "$ON" "$c")
    else on=$(run_wrk "$ON" "$c"); off=$(run_wrk "$OFF" "$c"); fi
    ratio=$(awk -v a="$on" -v b="$off" 'BEGIN {print a/b}')
    offs+=("$off"); ons+=("$on"); ratios+=("$ratio")
    printf "%-6s | %-5s | %12.0f | %12.0f | %.3f\n" "$c" "$r" "$off" "$on" "$ratio"
  done
  moff=$(printf '%s\n' "${offs[@]}" | median); mon=$(printf '%s\n' "${ons[@]}" | median)
  printf "%-6s | median| %12.0f | %12.0f | %.3f  (on / off of the medians; median of the" "$c" "$moff" "$mon" \
    "$(awk -v a="$mon" -v b="$moff" 'BEGIN {print a/b}')"
  printf " rounds' ratios: %.3f)\n" "$(printf '%s\n' "${ratios[@]}" | median)"
done
answered=$(metric "$ON_ADM" 'palisade_requests_total{outcome="admitted",route="bench"}')
sleep 0.3 # the writer flushes every 100 ms
echo "access log: $(wc -l <"$WORK/on/access.log") lines for $answered requests answered," \
  "dropped $(metric "$ON_ADM" 'palisade_access_log_dropped_lines_total{reason="full"}') (full)," \
  "$(du -h "$WORK/on/access.log" | cut -f1)"
