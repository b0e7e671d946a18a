#!/usr/bin/env bash
# Paired A/B: this build and another palisade binary on the same core at the same time, each
# under its own wrk, so that whatever else the machine does slows both alike.
#
# Why: on a shared two-core VM single load runs (benches/load.sh) move by 15-25 % from one
# minute to the next, more than most changes to the data path are worth. Run together on one
# core, the two builds split it by their CPU cost per request: the ratio of their request
# rates is the inverse ratio of their CPU per request, and the noise cancels (the same binary
# against itself gives 1.00 +/- 0.01 here).
#
# Usage: OTHER=/path/to/palisade benches/pair.sh            (default: 16 64 256 connections,
#        ROUNDS=3 DURATION=4 CONNS="256" OTHER=... benches/pair.sh   3 rounds of 4 s each;
#        THIS=/path/to/palisade OTHER=... benches/pair.sh   compares two built binaries;
#        EXTRA_THIS='response_timeout_ms = 0' OTHER=... benches/pair.sh   appends a line to
#        one build's configuration, after its [[route]] (EXTRA_OTHER: the other's);
#        TEMPLATED=100000 OTHER=... benches/pair.sh   both builds on a templated route over
#        that many entities (benches/common.sh's templated_conf: marks seeded at 5, every
#        entity opened first, each request naming the next entity))
# Prints, per round: each build's requests/s, p99 and CPU per request (user + system, from
# /proc/<pid>/stat), and this build / other.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OTHER:?set OTHER to the palisade binary to compare with}"
DURATION=${DURATION:-4}
ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-"16 64 256"}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

if [ -n "${THIS:-}" ]; then
    BIN=$(realpath "$THIS")
else
    cargo build --release --quiet --bin palisade
    BIN=$(realpath "${CARGO_TARGET_DIR:-target}/release/palisade")
fi

work_dir

UP=$(free_port); A=$(free_port); AA=$(free_port); B=$(free_port); BA=$(free_port)
upstream_conf "$WORK/upstream.conf" "$UP"
palisade_conf "$WORK/a/palisade.toml" "$A" "$AA" "$UP" http1 "${EXTRA_THIS:-}"
palisade_conf "$WORK/b/palisade.toml" "$B" "$BA" "$UP" http1 "${EXTRA_OTHER:-}"
SCRIPT=()
if [[ -n ${TEMPLATED:-} ]]; then
  templated_conf "$WORK/a/palisade.toml" "$TEMPLATED"
  templated_conf "$WORK/b/palisade.toml" "$TEMPLATED"
  SCRIPT=(-s "$WORK/a/entities.lua")
fi

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
(cd "$WORK/a" && RUST_LOG=warn exec "${PROXY_CPU[@]}" "$BIN" run --config palisade.toml 2>palisade.log) & PIDS+=($!)
A_PID=$!
(cd "$WORK/b" && RUST_LOG=warn exec "${PROXY_CPU[@]}" "$OTHER" run --config palisade.toml 2>palisade.log) & PIDS+=($!)
B_PID=$!
wait_port "$UP"; wait_port "$A"; wait_port "$B"
if [[ -n ${TEMPLATED:-} ]]; then
  open_entities "$A" "$TEMPLATED" "$WORK/a/entities.lua"
  open_entities "$B" "$TEMPLATED" "$WORK/a/entities.lua"
fi

TCK=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wrk_at() { "${LOAD_CPU[@]}" wrk -t1 -c"$1" -d"$2"s --latency "${SCRIPT[@]}" -H 'x-fencing-token: 5' "http://127.0.0.1:$3/orders/7"; }

echo "paired A/B: this build vs $OTHER, both on one core ($PIN), wrk -t1 each, $ROUNDS rounds of ${DURATION}s${TEMPLATED:+, templated route over $TEMPLATED entities}"
for c in $CONNS; do
  # Warm-up: connections open, marks loaded, caches filled.
  wrk_at "$c" 1 "$A" >/dev/null & w=$!; wrk_at "$c" 1 "$B" >/dev/null; wait "$w"
  ratios=()
  for _ in $(seq "$ROUNDS"); do
    a0=$(cpu_ticks "$A_PID"); b0=$(cpu_ticks "$B_PID")
    wrk_at "$c" "$DURATION" "$A" >"$WORK/a.out" & w=$!; wrk_at "$c" "$DURATION" "$B" >"$WORK/b.out"; wait "$w"
    a1=$(cpu_ticks "$A_PID"); b1=$(cpu_ticks "$B_PID")
    for out in a b; do
      if grep -q "Non-2xx" "$WORK/$out.out"; then echo "$out: non-2xx responses:" >&2; cat "$WORK/$out.out" >&2; exit 1; fi
    done
    na=$(awk '/requests in/ {print $1}' "$WORK/a.out"); nb=$(awk '/requests in/ {print $1}' "$WORK/b.out")
    pa=$(p99_ms <"$WORK/a.out"); pb=$(p99_ms <"$WORK/b.out")
    r=$(awk -v a="$na" -v b="$nb" 'BEGIN {printf "%.3f", a / b}')
    ratios+=("$r")
    awk -v c="$c" -v d="$DURATION" -v t="$TCK" -v na="$na" -v nb="$nb" -v pa="$pa" -v pb="$pb" \
      -v ca=$((a1 - a0)) -v cb=$((b1 - b0)) -v r="$r" 'BEGIN {
      printf "%4d conns | this build %6.0f rps (p99 %5.2f ms, %5.2f us/req) | other %6.0f rps (p99 %5.2f ms, %5.2f us/req) | this / other %sx\n",
        c, na / d, pa, ca * 1e6 / t / na, nb / d, pb, cb * 1e6 / t / nb, r }'
  done
  printf "%4d conns | median this / other: %sx\n" "$c" "$(printf '%s\n' "${ratios[@]}" | median)"
done
