#!/usr/bin/env bash
# Memory of many entities: palisade's resident set after ENTITIES (default 10^6) distinct
# entities were each admitted once through one templated route, with `[marks] max_cached` =
# CACHED (default 100000) and marks in the file store. Goal: at most 64 MiB.
#
# Method
# - Release build, 1 worker thread, pinned to core 0; wrk (-t1, CONNS connections, default 64)
#   and the upstream (nginx answering `200 ok`) on core 1.
# - Route `path_pattern = "/w/{id}"`, `resource = "w/{id}"`, `max_marks` above ENTITIES. wrk's
#   script sends `POST /w/<n>` with `x-fencing-token: 5` for n = 0, 1, 2, ... and stops at
#   ENTITIES answers: every request is a new entity, so every one is an advance from 0 to 5
#   (persisted, group-committed) and an insert into the cache, which evicts past CACHED.
# - Reported: VmRSS and VmHWM of palisade at the end, requests per second, the entities
#   cached/loaded/evicted (from /metrics), the marks stored and the file's size.
#
# Usage: benches/entities.sh     (ENTITIES=200000 benches/entities.sh to shorten)
set -euo pipefail
cd "$(dirname "$0")/.."
ENTITIES=${ENTITIES:-1000000}
CACHED=${CACHED:-100000}
CONNS=${CONNS:-64}

source "benches/common.sh"
need nginx nginx wrk wrk taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --bin palisade
BIN=${CARGO_TARGET_DIR:-target}/release/palisade

work_dir
UP=$(free_port); PAL=$(free_port); ADM=$(free_port)
upstream_conf "$WORK/upstream.conf" "$UP"
cat >"$WORK/palisade.toml" <<CONF
[proxy]
listen = "127.0.0.1:$PAL"
workers = 1
[admin]
listen = "127.0.0.1:$ADM"
[marks]
store = "file"
path = "marks.db"
max_cached = $CACHED
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:$UP"
[[route]]
name = "entities"
upstream = "legacy"
path_pattern = "/w/{id}"
resource = "w/{id}"
max_marks = $((ENTITIES * 2))
CONF
cat >"$WORK/entities.lua" <<LUA
wrk.method = "POST"
wrk.headers["x-fencing-token"] = "5"
local n, answered = -1, 0
request = function()
  n = n + 1
  return wrk.format(nil, "/w/" .. n)
end
response = function(status)
  answered = answered + 1
  if answered >= $ENTITIES then wrk.thread:stop() end
end
LUA

"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/palisade.toml" 2>"$WORK/palisade.log" & PIDS+=($!)
PAL_PID=$!
wait_port "$UP"; wait_port "$PAL"
echo "palisade at start: $(awk '/VmRSS/ {printf "%.1f MiB", $2 / 1024}' "/proc/$PAL_PID/status")"

metrics() { exec 3<>"/dev/tcp/127.0.0.1/$ADM"; printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3; cat <&3; exec 3>&-; }
val() { awk -v k="$1" 'index($0, k) == 1 {print $2}' <<<"$m"; }
answered() { m=$(metrics); val 'palisade_requests_total{outcome="admitted",route="entities"}'; }

# wrk stops sending at ENTITIES answers but only exits at its duration: stopped from here.
t0=$(date +%s.%N)
"${LOAD_CPU[@]}" wrk -t1 -c"$CONNS" -d3600s -s "$WORK/entities.lua" "http://127.0.0.1:$PAL/" >"$WORK/wrk.out" & WRK=$!
PIDS+=($WRK)
c0=$(cpu_ticks "$PAL_PID")
while (( $(answered || echo 0) < ENTITIES )); do
  kill -0 "$WRK" 2>/dev/null || { echo "wrk ended early:" >&2; cat "$WORK/wrk.out" >&2; exit 1; }
  sleep 0.5
done
t1=$(date +%s.%N)
c1=$(cpu_ticks "$PAL_PID")
kill "$WRK" 2>/dev/null || true
m=$(metrics)
echo "entities: $ENTITIES in $(awk -v a="$t0" -v b="$t1" -v n="$ENTITIES" 'BEGIN {printf "%.1f s (%.0f/s)", b - a, n / (b - a)}'), max_cached $CACHED, palisade CPU $(awk -v a="$c0" -v b="$c1" -v t="$(getconf CLK_TCK)" -v s="$t0" -v e="$t1" 'BEGIN {printf "%.0f%%", (b - a) / t / (e - s) * 100}')"
echo "answers other than admitted: $(awk '/^palisade_requests_total/ && !/admitted/ && $2 > 0' <<<"$m" | tr '\n' ' ')"
echo "cache: cached $(val 'palisade_entities_cached'), loaded $(val 'palisade_entities_loaded_total'), evicted $(val 'palisade_entities_evicted_total')"
echo "admitted: $(val 'palisade_requests_total{outcome="admitted",route="entities"}')"
echo "marks file: $(du -h "$WORK/marks.db" | cut -f1) (+ wal $(du -h "$WORK/marks.db-wal" 2>/dev/null | cut -f1))"
awk '/VmRSS|VmHWM/ {printf "palisade %s %.1f MiB\n", $1, $2 / 1024}' "/proc/$PAL_PID/status"
