#!/usr/bin/env bash
# The delayed-ACK stall behind an upstream that writes a response in two sends with Nagle on:
# one kept-alive connection, through palisade (both data paths) and nginx, against the
# upstream alone, in the same run.
#
# Why: an upstream that sends a response's head, then its body, with Nagle on (Python's
# http.server does) holds the body until the head is acknowledged. A proxy that reads the
# head, sends nothing and waits for the body leaves that ACK to Linux's delayed-ACK timer
# (up to 40 ms on a kept-alive connection): every request then takes ~40 ms more. palisade
# asks for a quick ACK (TCP_QUICKACK) when a read of the upstream must wait for the rest of a
# response (src/proxy/pipeline/up_tcp.rs); this script shows the stall and its absence.
#
# Method
# - The upstream is the README's own demo service, deploy/compose/upstream.py (Python's
#   ThreadingHTTPServer, HTTP/1.1 keep-alive, Content-Length set, Nagle on, wfile unbuffered:
#   end_headers() and the body are two sends), answering GET /healthz with `200 ok`.
# - Measured, each with wrk -t1 -c1 (one connection, one request at a time), 1 s warm-up then
#   DURATION seconds (default 5) with --latency: the upstream directly (wrk is a client that
#   waits for the whole response without a quick ACK, so it stalls there too); the same
#   upstream with Nagle off (its Handler with disable_nagle_algorithm = True, on another port:
#   the upstream's own latency without the stall, a reference only); nginx (1 worker,
#   `upstream { keepalive 16; }`, `proxy_http_version 1.1`, `proxy_set_header Connection ""`);
#   and each palisade binary given, twice: `[proxy] http1_fast_path = true` (the default,
#   "fast") and `false` ("hyper"). palisade: 1 worker thread, file mark store in a temp dir,
#   one unguarded route "/" to the upstream.
# - nginx and every palisade on core 0, wrk and the upstream on core 1 (taskset), when there
#   are two cores. ROUNDS rounds (default 1), order alternating; medians reported.
# - Reported: p50 and p99 latency (ms) and requests/s, and each against nginx's of the same
#   run. "stall" marks a p50 of 20 ms or more (the 40 ms timer, not the work, sets it).
#
# Debug builds show the stall as well as release ones: latency is then dominated by the 40 ms
# timer, not by the proxy's CPU. Throughput (and latency without the stall) is only comparable
# between binaries of the same profile, e.g. a debug build before a change against a debug
# build after it.
#
# Usage: benches/nagle.sh [BIN...]    palisade binaries to measure (default: builds and runs
#                                     target/release/palisade)
#        DURATION=10 ROUNDS=3 benches/nagle.sh /tmp/palisade-before /tmp/palisade-after
# Needs nginx, wrk and python3 (nginx and wrk installed with apt-get when missing and run as
# root).
set -euo pipefail
BINS=()
for b in "$@"; do
  [[ -x $b ]] || { echo "not an executable: $b" >&2; exit 1; }
  BINS+=("$(realpath "$b")")
done
cd "$(dirname "$0")/.."
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-1}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux python3 python3
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

if ((${#BINS[@]} == 0)); then
  cargo build --release --quiet --bin palisade
  BINS=("$(realpath "${CARGO_TARGET_DIR:-target}/release/palisade")")
fi

work_dir

UP=$(free_port); NODELAY=$(free_port); NGX=$(free_port)
PATH_GET=/healthz

"${LOAD_CPU[@]}" python3 deploy/compose/upstream.py "$UP" 127.0.0.1 >"$WORK/upstream.log" 2>&1 & PIDS+=($!)
UP_PID=$!
# The reference: the same handler, with TCP_NODELAY on its accepted sockets.
cat >"$WORK/nodelay.py" <<'PY'
import importlib.util, sys
from http.server import ThreadingHTTPServer
spec = importlib.util.spec_from_file_location("upstream", "deploy/compose/upstream.py")
upstream = importlib.util.module_from_spec(spec)
spec.loader.exec_module(upstream)
upstream.Handler.disable_nagle_algorithm = True
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), upstream.Handler).serve_forever()
PY
"${LOAD_CPU[@]}" python3 "$WORK/nodelay.py" "$NODELAY" >"$WORK/nodelay.log" 2>&1 & PIDS+=($!)
NODELAY_PID=$!

proxy_nginx_conf "$WORK/nginx.conf" "$NGX" "$UP" 1024 "keepalive 16; keepalive_requests 1000000;"
"${PROXY_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' & PIDS+=($!)

NAMES=(nodelay direct nginx)
declare -A PORT=([nodelay]=$NODELAY [direct]=$UP [nginx]=$NGX)
declare -A PID=([nodelay]=$NODELAY_PID [direct]=$UP_PID [nginx]=$!)
declare -A LOG=([nodelay]=$WORK/nodelay.log [direct]=$WORK/upstream.log [nginx]=$WORK/nginx.err)
declare -A LABEL=([nodelay]="upstream direct, Nagle off" [direct]="upstream direct" [nginx]="nginx keepalive 16")

# One palisade per binary and data path, each in its own directory (marks file, lock).
declare -A SEEN=()
i=0
for bin in "${BINS[@]}"; do
  i=$((i + 1))
  base=$(basename "$bin")
  if [[ -n ${SEEN[$base]:-} ]]; then base="$base#$i"; fi
  SEEN[$base]=1
  for path in fast hyper; do
    name="p$i-$path"
    listen=$(free_port); admin=$(free_port)
    mkdir -p "$WORK/$name"
    cat >"$WORK/$name/palisade.toml" <<CONF
[proxy]
listen = "127.0.0.1:$listen"
workers = 1
http1_fast_path = $([[ $path == fast ]] && echo true || echo false)
[admin]
listen = "127.0.0.1:$admin"
[marks]
store = "file"
path = "marks.db"
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:$UP"
protocol = "http1"
[[route]]
name = "all"
upstream = "legacy"
path_prefix = "/"
guard = false
CONF
    RUST_LOG=warn "${PROXY_CPU[@]}" "$bin" run --config "$WORK/$name/palisade.toml" 2>"$WORK/$name/palisade.log" & PIDS+=($!)
    PID[$name]=$!; PORT[$name]=$listen; LOG[$name]=$WORK/$name/palisade.log
    LABEL[$name]="$base, $path path"
    NAMES+=("$name")
  done
done
# Waits (30 s at most: debug builds on a busy machine start slowly) until $1 listens; says
# why not when its process ended.
wait_up() {
  for _ in $(seq 600); do
    (echo >"/dev/tcp/127.0.0.1/${PORT[$1]}") 2>/dev/null && return
    if ! kill -0 "${PID[$1]}" 2>/dev/null; then
      echo "${LABEL[$1]} exited before listening on ${PORT[$1]}:" >&2; cat "${LOG[$1]}" >&2; exit 1
    fi
    sleep 0.05
  done
  echo "${LABEL[$1]}: nothing listens on port ${PORT[$1]}" >&2; cat "${LOG[$1]}" >&2; exit 1
}
for name in "${NAMES[@]}"; do wait_up "$name"; done

# wrk's latency percentile $1 (50, 99, ...) in ms, from its --latency output on stdin.
pct_ms() {
  awk -v p="$1%" '$1 == p {v = $2
    if (v ~ /us$/) {sub(/us$/, "", v); v /= 1000} else if (v ~ /ms$/) {sub(/ms$/, "", v)}
    else if (v ~ /m$/) {sub(/m$/, "", v); v *= 60000} else if (v ~ /s$/) {sub(/s$/, "", v); v *= 1000}
    print v}'
}

run_wrk() { # name -> "p50_ms p99_ms rps"
  local url="http://127.0.0.1:${PORT[$1]}$PATH_GET" out
  "${LOAD_CPU[@]}" wrk -t1 -c1 -d1s "$url" >/dev/null
  out=$("${LOAD_CPU[@]}" wrk -t1 -c1 -d"${DURATION}s" --latency "$url")
  if grep -qE "Non-2xx|Socket errors" <<<"$out"; then
    echo "${LABEL[$1]}: errors:" >&2; echo "$out" >&2; exit 1
  fi
  echo "$(pct_ms 50 <<<"$out") $(pct_ms 99 <<<"$out") $(awk '/^Requests\/sec:/ {print $2}' <<<"$out")"
}

echo "palisade behind a Nagle upstream (deploy/compose/upstream.py, GET $PATH_GET): $(nproc) cores, $PIN,"
echo "wrk -t1 -c1, ${ROUNDS} round(s) of ${DURATION}s each (medians over rounds)"
RESULTS="$WORK/results"
: >"$RESULTS"
for r in $(seq "$ROUNDS"); do
  order=("${NAMES[@]}")
  if ((r % 2 == 0)); then mapfile -t order < <(printf '%s\n' "${NAMES[@]}" | tac); fi
  for name in "${order[@]}"; do echo "$name $(run_wrk "$name")" >>"$RESULTS"; done
done

stat() { awk -v n="$1" -v f="$2" '$1 == n {print $f}' "$RESULTS" | median; }
N50=$(stat nginx 2); N99=$(stat nginx 3); NRPS=$(stat nginx 4)
w=15
for name in "${NAMES[@]}"; do if ((${#LABEL[$name]} > w)); then w=${#LABEL[$name]}; fi; done
printf "%-${w}s | %8s | %8s | %8s | %11s | %11s | %13s |\n" target "p50 ms" "p99 ms" "req/s" \
  "p50 / nginx" "p99 / nginx" "req/s / nginx"
for name in "${NAMES[@]}"; do
  p50=$(stat "$name" 2); p99=$(stat "$name" 3); rps=$(stat "$name" 4)
  awk -v l="${LABEL[$name]}" -v w="$w" -v a="$p50" -v b="$p99" -v c="$rps" -v na="$N50" \
    -v nb="$N99" -v nc="$NRPS" 'BEGIN {
      printf "%-*s | %8.2f | %8.2f | %8.0f | %10.3gx | %10.3gx | %12.3gx | %s\n", w, l, a, b, c,
        a / na, b / nb, c / nc, (a >= 20 ? "stall" : "")}'
done
