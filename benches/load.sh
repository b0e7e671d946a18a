#!/usr/bin/env bash
# Load test: palisade (guard on, token header set) vs nginx and HAProxy as reverse proxies vs
# the upstream alone, interleaved in the same run, with wrk -t1 at 16, 64 and 256 connections.
#
# Method
# - The upstream is a separate nginx instance answering `200 ok` from memory (1 worker), so
#   that the proxy under test, not the upstream, is the bottleneck.
# - On a machine with two or more cores every proxy under test is pinned to core 0, and wrk plus
#   the upstream to core 1 (taskset), so palisade, nginx and HAProxy get the same single core.
# - palisade: release build, 1 worker thread, file mark store, a guarded route; every request
#   carries `x-fencing-token: 5` (after the first request: the equal-token fast path).
# - nginx: 1 worker, HTTP/1.1 to the upstream with `keepalive 1024`, access log off.
# - HAProxy (Debian package): `nbthread 1`, `http-reuse always`, no logging.
# - ROUNDS rounds (default 3); in each, every proxy runs at each concurrency, in an order that
#   alternates between rounds. Each run: 1 s warm-up, then DURATION seconds (default 8).
#   Reported: the median over rounds of requests/s, p99 and CPU time per request (user +
#   system of the proxy's process, from /proc/<pid>/stat), and palisade's peak RSS (VmHWM).
#
# Usage: benches/load.sh            (ROUNDS=1 DURATION=4 CONNS="16 64" benches/load.sh to shorten)
#        BASELINE=/path/to/older/palisade benches/load.sh   also runs that binary, same config,
#        interleaved, and prints this build / baseline (before/after a change).
#        FAST_PATH=both benches/load.sh   runs palisade with `[proxy] http1_fast_path = true`
#        ("palisade") and a second instance with it off ("hyper-path"), interleaved, and prints
#        fast / hyper path. FAST_PATH=on or off sets it for the one palisade.
#        TEMPLATED=100000 benches/load.sh   also runs palisade with a templated route
#        (`path_pattern = "/w/{id}"`, `resource = "w/{id}"`, one mark per entity, 100000
#        entities seeded at mark 5 and all opened during a warm-up pass), both palisades sent
#        `/w/<n>` for n cycling over the entities (a wrk script), and prints templated / fixed
#        (the goal: >= 0.95x). With BASELINE too, the baseline binary also runs the templated
#        route ("templated-baseline") and this build's templated / the baseline's is printed.
#        RESULTS_OUT=file benches/load.sh   also keeps every run's line there ("name conns rps
#        p99_ms cpu_us_per_req round"), for the spread behind the medians.
#   A ratio between two palisades (this build / baseline, templated / fixed, fast / hyper
#   path) is the median over rounds of the ratio within each round, the two run one after the
#   other (the compared instances are adjacent in the order): on a machine whose speed drifts
#   (a shared VM), a ratio of medians taken minutes apart measures the drift. The rounds'
#   lowest and highest ratio are printed beside it.
# Needs nginx, haproxy and wrk (installed with apt-get when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-"16 64 256"}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux haproxy haproxy
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
HAPROXY=$(command -v haproxy || echo /usr/sbin/haproxy)

cargo build --release --quiet --bin palisade
BIN=${CARGO_TARGET_DIR:-target}/release/palisade

work_dir

UP=$(free_port); NGX=$(free_port); HAP=$(free_port); PAL=$(free_port); ADM=$(free_port)
BPAL=$(free_port); BADM=$(free_port)

upstream_conf "$WORK/upstream.conf" "$UP"
proxy_nginx_conf "$WORK/nginx.conf" "$NGX" "$UP" 4096 "keepalive 1024;"
cat >"$WORK/haproxy.cfg" <<CONF
global
  nbthread 1
  maxconn 8192
defaults
  mode http
  timeout connect 2s
  timeout client 30s
  timeout server 30s
  http-reuse always
frontend fe
  bind 127.0.0.1:$HAP
  default_backend be
backend be
  server up 127.0.0.1:$UP
CONF
palisade_conf "$WORK/palisade.toml" "$PAL" "$ADM" "$UP"
case ${FAST_PATH:-} in
  both | on) sed -i 's/^\[proxy\]$/[proxy]\nhttp1_fast_path = true/' "$WORK/palisade.toml" ;;
  off) sed -i 's/^\[proxy\]$/[proxy]\nhttp1_fast_path = false/' "$WORK/palisade.toml" ;;
esac

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
"${PROXY_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/nginx.conf" -g 'daemon off;' & PIDS+=($!)
NGINX_MASTER=$!
"${PROXY_CPU[@]}" "$HAPROXY" -f "$WORK/haproxy.cfg" -db & PIDS+=($!)
HAP_PID=$!
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/palisade.toml" 2>"$WORK/palisade.log" & PIDS+=($!)
PAL_PID=$!
wait_port "$UP"; wait_port "$NGX"; wait_port "$HAP"; wait_port "$PAL"
NGINX_WORKER=$(pgrep -P "$NGINX_MASTER" | head -1)
NAMES=(palisade nginx haproxy direct)
declare -A PORT=([palisade]=$PAL [nginx]=$NGX [haproxy]=$HAP [direct]=$UP)
declare -A PID=([palisade]=$PAL_PID [nginx]=$NGINX_WORKER [haproxy]=$HAP_PID [direct]=)
if [[ -n ${BASELINE:-} ]]; then
  mkdir -p "$WORK/baseline"
  sed -e "s/127.0.0.1:$PAL/127.0.0.1:$BPAL/" -e "s/127.0.0.1:$ADM/127.0.0.1:$BADM/" \
    "$WORK/palisade.toml" >"$WORK/baseline/palisade.toml"
  RUST_LOG=warn "${PROXY_CPU[@]}" "$BASELINE" run --config "$WORK/baseline/palisade.toml" 2>"$WORK/baseline.log" & PIDS+=($!)
  PID[baseline]=$!; PORT[baseline]=$BPAL; NAMES+=(baseline)
  wait_port "$BPAL"
fi

if [[ ${FAST_PATH:-} == both ]]; then
  HPAL=$(free_port); HADM=$(free_port)
  mkdir -p "$WORK/hyper"
  sed -e "s/127.0.0.1:$PAL/127.0.0.1:$HPAL/" -e "s/127.0.0.1:$ADM/127.0.0.1:$HADM/" \
    -e 's/^http1_fast_path = true$/http1_fast_path = false/' \
    "$WORK/palisade.toml" >"$WORK/hyper/palisade.toml"
  RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/hyper/palisade.toml" 2>"$WORK/hyper.log" & PIDS+=($!)
  PID[hyper-path]=$!; PORT[hyper-path]=$HPAL; NAMES+=(hyper-path)
  wait_port "$HPAL"
fi

declare -A SCRIPT=()
if [[ -n ${TEMPLATED:-} ]]; then
  TPAL=$(free_port); TADM=$(free_port)
  mkdir -p "$WORK/templated"
  sed -e "s/127.0.0.1:$PAL/127.0.0.1:$TPAL/" -e "s/127.0.0.1:$ADM/127.0.0.1:$TADM/" \
    "$WORK/palisade.toml" >"$WORK/templated/palisade.toml"
  templated_conf "$WORK/templated/palisade.toml" "$TEMPLATED"
  cp "$WORK/templated/entities.lua" "$WORK/entities.lua"
  cp "$WORK/templated/marks.json" "$WORK/seed-marks.json" # palisade migrates it at start
  RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/templated/palisade.toml" 2>"$WORK/templated.log" & PIDS+=($!)
  PID[templated]=$!; PORT[templated]=$TPAL; NAMES+=(templated)
  wait_port "$TPAL"
  SCRIPT[palisade]=$WORK/entities.lua; SCRIPT[templated]=$WORK/entities.lua
  if [[ -n ${BASELINE:-} ]]; then
    SCRIPT[baseline]=$WORK/entities.lua
    TBPAL=$(free_port); TBADM=$(free_port)
    mkdir -p "$WORK/templated-baseline"
    sed -e "s/127.0.0.1:$TPAL/127.0.0.1:$TBPAL/" -e "s/127.0.0.1:$TADM/127.0.0.1:$TBADM/" \
      "$WORK/templated/palisade.toml" >"$WORK/templated-baseline/palisade.toml"
    cp "$WORK/seed-marks.json" "$WORK/templated-baseline/marks.json"
    RUST_LOG=warn "${PROXY_CPU[@]}" "$BASELINE" run --config "$WORK/templated-baseline/palisade.toml" 2>"$WORK/templated-baseline.log" & PIDS+=($!)
    PID[templated-baseline]=$!; PORT[templated-baseline]=$TBPAL; NAMES+=(templated-baseline)
    SCRIPT[templated-baseline]=$WORK/entities.lua
    wait_port "$TBPAL"
  fi
  # Opens every entity once (each first use reads its mark from the store).
  for port in "$TPAL" ${TBPAL:+"$TBPAL"}; do open_entities "$port" "$TEMPLATED" "$WORK/entities.lua"; done
fi

# The compared palisades first and side by side (each ratio is taken within a round).
mapfile -t NAMES < <(printf '%s\n' "${NAMES[@]}" | awk '
  {n[NR] = $0}
  END {
    split("palisade templated baseline templated-baseline hyper-path", first, " ")
    for (i = 1; i in first; i++) for (j = 1; j <= NR; j++) if (n[j] == first[i]) {print n[j]; n[j] = ""}
    for (j = 1; j <= NR; j++) if (n[j] != "") print n[j]
  }')

TICK=$(getconf CLK_TCK)

run_wrk() { # name conns -> "rps p99_ms cpu_us_per_req"
  local port=${PORT[$1]} pid=${PID[$1]} out t0 t1 n script=()
  if [[ -n ${SCRIPT[$1]:-} ]]; then script=(-s "${SCRIPT[$1]}"); fi
  "${LOAD_CPU[@]}" wrk -t1 -c"$2" -d1s "${script[@]}" -H 'x-fencing-token: 5' "http://127.0.0.1:$port/orders/7" >/dev/null
  t0=$(cpu_ticks "$pid")
  out=$("${LOAD_CPU[@]}" wrk -t1 -c"$2" -d"${DURATION}s" --latency "${script[@]}" -H 'x-fencing-token: 5' "http://127.0.0.1:$port/orders/7")
  t1=$(cpu_ticks "$pid")
  if grep -q "Non-2xx" <<<"$out"; then echo "$1: non-2xx responses:" >&2; echo "$out" >&2; exit 1; fi
  n=$(awk '/requests in/ {print $1}' <<<"$out")
  echo "$(awk '/^Requests\/sec:/ {print $2}' <<<"$out") $(p99_ms <<<"$out") $(awk -v a="$t0" -v b="$t1" -v n="$n" -v t="$TICK" 'BEGIN {printf "%.2f", (b - a) * 1e6 / t / n}')"
}

echo "palisade load test: $(nproc) cores, $PIN, wrk -t1, ${ROUNDS} rounds of ${DURATION}s, medians"
RESULTS="$WORK/results"
: >"$RESULTS"
for r in $(seq "$ROUNDS"); do
  order=("${NAMES[@]}")
  if ((r % 2 == 0)); then mapfile -t order < <(printf '%s\n' "${NAMES[@]}" | tac); fi
  for c in $CONNS; do
    for name in "${order[@]}"; do
      echo "$name $c $(run_wrk "$name" "$c") $r" >>"$RESULTS"
    done
  done
done

if [[ -n ${RESULTS_OUT:-} ]]; then cp "$RESULTS" "$RESULTS_OUT"; fi
stat() { awk -v n="$1" -v c="$2" -v f="$3" '$1 == n && $2 == c {print $f}' "$RESULTS" | median; }
# paired A B CONNS FIELD -> "median lowest highest" of A / B within each round.
paired() {
  local ratios m
  ratios=$(awk -v a="$1" -v b="$2" -v c="$3" -v f="$4" '
    $2 == c && $1 == a {x[$6] = $f}
    $2 == c && $1 == b {y[$6] = $f}
    END {for (r in x) if (r in y && y[r] > 0) print x[r] / y[r]}' "$RESULTS" | sort -g)
  m=$(median <<<"$ratios")
  echo "$m $(head -1 <<<"$ratios") $(tail -1 <<<"$ratios")"
}
# ratio LABEL A B CONNS: the paired requests/s and CPU-per-request ratios of A to B.
ratio() {
  local rps cpu
  read -r -a rps <<<"$(paired "$2" "$3" "$4" 3)"
  read -r -a cpu <<<"$(paired "$2" "$3" "$4" 5)"
  printf "       %s: rps %.3fx (rounds %.3f..%.3f), cpu per request %.3fx (%.3f..%.3f)\n" \
    "$1" "${rps[@]}" "${cpu[@]}"
}
printf "%-6s" conns
for name in "${NAMES[@]}"; do printf " | %-26s" "$name rps (p99 ms, us/req)"; done
printf " | %s\n" "palisade / best peer: rps, p99"
for c in $CONNS; do
  printf "%-6s" "$c"
  for name in "${NAMES[@]}"; do
    cpu=$(stat "$name" "$c" 5)
    [[ $name == direct ]] && cpu="-"
    printf " | %9.0f (%6.2f, %5s)   " "$(stat "$name" "$c" 3)" "$(stat "$name" "$c" 4)" "$cpu"
  done
  best=$(awk -v a="$(stat nginx "$c" 3)" -v b="$(stat haproxy "$c" 3)" 'BEGIN {print (a > b ? "nginx" : "haproxy")}')
  awk -v p="$(stat palisade "$c" 3)" -v b="$(stat "$best" "$c" 3)" -v pp="$(stat palisade "$c" 4)" \
    -v bp="$(stat "$best" "$c" 4)" -v n="$best" 'BEGIN {printf " | %.2fx, %.2fx (vs %s)\n", p / b, pp / bp, n}'
  if [[ -n ${BASELINE:-} ]]; then ratio "this build / baseline" palisade baseline "$c"; fi
  if [[ -n ${TEMPLATED:-} ]]; then
    ratio "templated ($TEMPLATED entities) / fixed route" templated palisade "$c"
    if [[ -n ${BASELINE:-} ]]; then
      ratio "templated, this build / baseline" templated templated-baseline "$c"
    fi
  fi
  if [[ ${FAST_PATH:-} == both ]]; then
    ratio "fast path / hyper path" palisade hyper-path "$c"
    best=$(awk -v a="$(stat nginx "$c" 3)" -v b="$(stat haproxy "$c" 3)" 'BEGIN {print (a > b ? "nginx" : "haproxy")}')
    awk -v h="$(stat hyper-path "$c" 3)" -v b="$(stat "$best" "$c" 3)" -v n="$best" \
      'BEGIN {printf "       hyper path / %s: %.2fx\n", n, h / b}'
  fi
done
echo "palisade peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2 / 1024}' "/proc/$PAL_PID/status")"
curl_metrics() { exec 3<>"/dev/tcp/127.0.0.1/$ADM"; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; cat <&3; exec 3>&-; }
echo "palisade admitted: $(curl_metrics | awk '/^palisade_requests_total\{outcome="admitted",route="bench"\}/ {print $2}')"
