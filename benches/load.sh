#!/usr/bin/env bash
# Load test: palisade (guard on, token header set) vs nginx as a reverse proxy vs the upstream
# alone, one after another in the same run, with wrk -t1 at 16, 64 and 256 connections.
#
# Method
# - The upstream is a separate nginx instance answering `200 ok` from memory (1 worker), so
#   that the proxy under test, not the upstream, is the bottleneck.
# - On a machine with two or more cores the proxy under test is pinned to core 0, and wrk plus
#   the upstream to core 1 (taskset), so palisade and nginx get the same single core.
# - palisade: release build, 1 worker thread, file mark store, a guarded route; every request
#   carries `x-fencing-token: 5` (after the first request: the equal-token fast path).
# - nginx: 1 worker, HTTP/1.1 to the upstream with `keepalive 1024`, access log off.
# - Each run: 2 s warm-up, then DURATION seconds measured (default 10).
#
# Usage: benches/load.sh            (DURATION=5 CONNS="16 64" benches/load.sh to shorten)
#        BASELINE=/path/to/older/palisade benches/load.sh   also runs that binary, same config,
#        interleaved in the same run, and prints this build / baseline (before/after a change).
# Needs nginx and wrk (installed with apt-get when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
CONNS=${CONNS:-"16 64 256"}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --bin palisade
BIN=target/release/palisade



WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

UP=$(free_port); NGX=$(free_port); PAL=$(free_port); ADM=$(free_port); BPAL=$(free_port); BADM=$(free_port)

cat >"$WORK/upstream.conf" <<CONF
worker_processes 1;
pid $WORK/upstream.pid;
error_log $WORK/upstream.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP reuseport; location / { return 200 "ok\n"; } }
}
CONF
cat >"$WORK/nginx.conf" <<CONF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  upstream legacy { server 127.0.0.1:$UP; keepalive 1024; }
  server {
    listen 127.0.0.1:$NGX;
    location / {
      proxy_pass http://legacy;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
CONF
cat >"$WORK/palisade.toml" <<CONF
[proxy]
listen = "127.0.0.1:$PAL"
workers = 1
[admin]
listen = "127.0.0.1:$ADM"
[marks]
store = "file"
path = "marks.json"
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:$UP"
[[route]]
name = "bench"
upstream = "legacy"
path_prefix = "/"
resource = "bench"
CONF

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
"${PROXY_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' & PIDS+=($!)
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/palisade.toml" 2>"$WORK/palisade.log" & PIDS+=($!)
wait_port "$UP"; wait_port "$NGX"; wait_port "$PAL"
if [[ -n ${BASELINE:-} ]]; then
  mkdir -p "$WORK/baseline"
  sed -e "s/127.0.0.1:$PAL/127.0.0.1:$BPAL/" -e "s/127.0.0.1:$ADM/127.0.0.1:$BADM/" \
    "$WORK/palisade.toml" >"$WORK/baseline/palisade.toml"
  RUST_LOG=warn "${PROXY_CPU[@]}" "$BASELINE" run --config "$WORK/baseline/palisade.toml" 2>"$WORK/baseline.log" & PIDS+=($!)
  wait_port "$BPAL"
fi

run_wrk() { # name port conns -> "rps p99_ms"
  local out
  "${LOAD_CPU[@]}" wrk -t1 -c"$3" -d2s -H 'x-fencing-token: 5' "http://127.0.0.1:$2/orders/7" >/dev/null
  out=$("${LOAD_CPU[@]}" wrk -t1 -c"$3" -d"${DURATION}s" --latency -H 'x-fencing-token: 5' "http://127.0.0.1:$2/orders/7")
  if grep -q "Non-2xx" <<<"$out"; then echo "$1: non-2xx responses:" >&2; echo "$out" >&2; exit 1; fi
  local rps p99
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(p99_ms <<<"$out")
  echo "$rps $p99"
}

echo "palisade load test: $(nproc) cores, $PIN, wrk -t1, ${DURATION}s per run"
printf "%-6s | %-22s | %-22s | %-22s | %s\n" conns "palisade rps (p99 ms)" "nginx rps (p99 ms)" "direct rps (p99 ms)" "palisade/nginx rps, p99"
for c in $CONNS; do
  read -r prps pp99 < <(run_wrk palisade "$PAL" "$c")
  read -r nrps np99 < <(run_wrk nginx "$NGX" "$c")
  read -r drps dp99 < <(run_wrk direct "$UP" "$c")
  ratio=$(awk -v a="$prps" -v b="$nrps" 'BEGIN {printf "%.2f", a/b}')
  if [[ -n ${BASELINE:-} ]]; then
    read -r brps bp99 < <(run_wrk baseline "$BPAL" "$c")
    base_line=$(awk -v a="$prps" -v b="$brps" -v p="$bp99" 'BEGIN {printf "baseline %.0f rps (p99 %.2f ms): this/baseline %.3fx", b, p, a/b}')
  fi
  pratio=$(awk -v a="$pp99" -v b="$np99" 'BEGIN {printf "%.2f", a/b}')
  printf "%-6s | %10.0f (%7.2f)    | %10.0f (%7.2f)    | %10.0f (%7.2f)    | %sx, %sx\n" \
    "$c" "$prps" "$pp99" "$nrps" "$np99" "$drps" "$dp99" "$ratio" "$pratio"
  [[ -n ${BASELINE:-} ]] && echo "       $base_line"
done
curl_metrics() { exec 3<>/dev/tcp/127.0.0.1/$ADM; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; cat <&3; exec 3>&-; }
echo "palisade admitted: $(curl_metrics | awk '/^palisade_requests_total\{outcome="admitted",route="bench"\}/ {print $2}')"
