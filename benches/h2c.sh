#!/usr/bin/env bash
# HTTP/2 load test: h2load through palisade (h2c in, guard on, h2c upstream) vs nginx
# (`listen ... http2`, `grpc_pass` to the same h2c upstream) vs the upstream alone.
#
# - The upstream is an nginx instance answering `200 ok` over h2c (1 worker), on core 1 with
#   h2load; palisade and nginx under test on core 0.
# - h2load: CLIENTS connections x STREAMS concurrent streams each, DURATION seconds (default 8)
#   after a 1 s warm-up, every request with `x-fencing-token: 5`. ROUNDS rounds (default 3),
#   order alternating, medians reported, with CPU time per request of each proxy.
#
# Usage: benches/h2c.sh     (ROUNDS=1 DURATION=4 benches/h2c.sh to shorten)
# Needs nginx, h2load (nghttp2-client); installed with apt-get when missing and run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-3}
LOADS=${LOADS:-"4x16 16x16 64x4"} # connections x streams per connection

source "benches/common.sh"
need nginx nginx h2load nghttp2-client taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --bin palisade
BIN=target/release/palisade

work_dir

UP=$(free_port); NGX=$(free_port); PAL=$(free_port); ADM=$(free_port)
upstream_conf "$WORK/upstream.conf" "$UP" http2
cat >"$WORK/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  http2_max_concurrent_streams 1024;
  upstream legacy { server 127.0.0.1:$UP; keepalive 1024; }
  server { listen 127.0.0.1:$NGX http2; location / { grpc_pass grpc://legacy; } }
}
CONF
palisade_conf "$WORK/palisade.toml" "$PAL" "$ADM" "$UP" h2c

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
"${PROXY_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' & PIDS+=($!)
NGINX_MASTER=$!
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/palisade.toml" 2>"$WORK/palisade.log" & PIDS+=($!)
PAL_PID=$!
wait_port "$UP"; wait_port "$NGX"; wait_port "$PAL"
NGINX_WORKER=$(pgrep -P "$NGINX_MASTER" | head -1)
NAMES=(palisade nginx direct)
declare -A PORT=([palisade]=$PAL [nginx]=$NGX [direct]=$UP)
declare -A PID=([palisade]=$PAL_PID [nginx]=$NGINX_WORKER [direct]=)
TICK=$(getconf CLK_TCK)

run_h2load() { # name CxS -> "rps cpu_us_per_req"
  local port=${PORT[$1]} pid=${PID[$1]} c=${2%x*} m=${2#*x} out t0 t1 n
  "${LOAD_CPU[@]}" h2load -c"$c" -m"$m" -D1 -H 'x-fencing-token: 5' "http://127.0.0.1:$port/orders/7" >/dev/null
  t0=$(cpu_ticks "$pid")
  out=$("${LOAD_CPU[@]}" h2load -c"$c" -m"$m" -D"$DURATION" -H 'x-fencing-token: 5' "http://127.0.0.1:$port/orders/7")
  t1=$(cpu_ticks "$pid")
  n=$(awk '/^status codes:/ {print $3}' <<<"$out")
  if ! grep -q " 0 failed, 0 errored" <<<"$out" || [[ ${n:-0} -eq 0 ]]; then echo "$1: failures:" >&2; echo "$out" >&2; exit 1; fi
  echo "$(awk '/^finished in/ {print $4}' <<<"$out") $(awk -v a="$t0" -v b="$t1" -v n="$n" -v t="$TICK" 'BEGIN {printf "%.2f", (b - a) * 1e6 / t / n}')"
}

echo "palisade h2c load test: $(nproc) cores, $PIN, h2load, ${ROUNDS} rounds of ${DURATION}s, medians"
RESULTS="$WORK/results"
: >"$RESULTS"
for r in $(seq "$ROUNDS"); do
  order=("${NAMES[@]}")
  if ((r % 2 == 0)); then mapfile -t order < <(printf '%s\n' "${NAMES[@]}" | tac); fi
  for l in $LOADS; do
    for name in "${order[@]}"; do echo "$name $l $(run_h2load "$name" "$l")" >>"$RESULTS"; done
  done
done
stat() { awk -v n="$1" -v l="$2" -v f="$3" '$1 == n && $2 == l {print $f}' "$RESULTS" | median; }
printf "%-8s | %-24s | %-24s | %-12s | %s\n" "conns x streams" "palisade req/s (us/req)" "nginx req/s (us/req)" "direct req/s" "palisade/nginx"
for l in $LOADS; do
  printf "%-8s | %12.0f (%6.2f)   | %12.0f (%6.2f)   | %12.0f | %.2fx\n" "$l" \
    "$(stat palisade "$l" 3)" "$(stat palisade "$l" 4)" "$(stat nginx "$l" 3)" "$(stat nginx "$l" 4)" \
    "$(stat direct "$l" 3)" "$(awk -v a="$(stat palisade "$l" 3)" -v b="$(stat nginx "$l" 3)" 'BEGIN {print a / b}')"
done
echo "palisade peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2 / 1024}' "/proc/$PAL_PID/status")"
