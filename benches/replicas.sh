#!/usr/bin/env bash
# Load test of the mark stores: one palisade replica (guard on, token header set, the
# equal-token path) with the file store, the etcd store in linearizable mode, the same with
# the route fed by a lock (`lock = "bench-lock"`: every confirmation reads the lock's epoch
# too, the token is the epoch's revision), the etcd store in cached mode, and cached with the
# lock (the epoch followed by a watch), one after
# another in the same run, with wrk -t1 at 64 connections (CONNS to change).
#
# Method
# - The upstream is nginx answering `200 ok` from memory (1 worker); etcd is one local node
#   (Debian's etcd-server) with --heartbeat-interval=10 --election-timeout=100.
# - On two or more cores palisade is pinned to core 0 and wrk, nginx and etcd to core 1.
# - palisade: release build with the `etcd` feature, 1 worker thread.
# - Each run: 2 s warm-up, then DURATION seconds measured (default 10).
# - etcd round trips per admitted request = the growth of
#   palisade_store_operation_duration_seconds_count{op="confirm"} (plus op="persist") divided by
#   the growth of palisade_requests_total{outcome="admitted"} over the measured run.
# - Also over the measured run: CPU of palisade and of etcd (share of one core), idle time of
#   the load core (near 0: wrk, nginx and etcd, not palisade, set the pace), the machine's
#   steal time (the hypervisor's: above a few % the run is noise), and the mean duration of
#   a confirmation read as palisade sees it.
# - REPEAT runs of each (default 1), the median's line printed. BEFORE=path/to/palisade runs
#   every store with that binary too, interleaved with this tree's, for a before/after in one
#   run.
#
# Usage: benches/replicas.sh   (DURATION=5 CONNS="16 64" benches/replicas.sh to shorten;
#        BEFORE=/tmp/palisade-old REPEAT=3 benches/replicas.sh to compare builds)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
CONNS=${CONNS:-"64"}
REPEAT=${REPEAT:-1}

source "benches/common.sh"
need nginx nginx wrk wrk etcd etcd-server etcdctl etcd-client protoc protobuf-compiler taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --features etcd --bin palisade
BIN=target/release/palisade
BUILDS=("now:$BIN")
if [[ -n ${BEFORE:-} ]]; then BUILDS=("before:$BEFORE" "${BUILDS[@]}"); fi



work_dir

UP=$(free_port); ETCD=$(free_port); PEER=$(free_port)
cat >"$WORK/upstream.conf" <<CONF
worker_processes 1;
pid $WORK/upstream.pid;
error_log $WORK/upstream.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP; location / { return 200 "ok\n"; } }
}
CONF
"${LOAD_CPU[@]}" "$NGINX" -p "$WORK" -c "$WORK/upstream.conf" -g 'daemon off;' & PIDS+=($!)
"${LOAD_CPU[@]}" etcd --name bench --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD" --advertise-client-urls "http://127.0.0.1:$ETCD" \
  --listen-peer-urls "http://127.0.0.1:$PEER" --initial-advertise-peer-urls "http://127.0.0.1:$PEER" \
  --initial-cluster "bench=http://127.0.0.1:$PEER" ${ETCD_TIMING:---heartbeat-interval=10 --election-timeout=100} \
  >"$WORK/etcd.log" 2>&1 & PIDS+=($!); ETCD_PID=$!
wait_port "$UP"; wait_port "$ETCD"

cpu_ticks() { # pid -> user+system clock ticks of the process so far
  awk '{print $14 + $15}' "/proc/$1/stat"
}

idle_ticks() { # -> idle clock ticks of the load generator's core (core 1; all cores on one)
  awk -v c="$([[ ${#LOAD_CPU[@]} -gt 0 ]] && echo cpu1 || echo cpu)" '$1 == c {print $5}' /proc/stat
}

steal_ticks() { # -> clock ticks the hypervisor took from this machine, all cores
  awk '$1 == "cpu" {print $9}' /proc/stat
}

percent() { # ticks -> share of one core over the measured run
  awk -v d="$1" -v hz="$(getconf CLK_TCK)" -v s="$DURATION" 'BEGIN {printf "%.0f", 100 * d / hz / s}'
}

metric() { # admin-port series -> value
  exec 3<>/dev/tcp/127.0.0.1/$1
  printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  awk -v s="$2" 'index($0, s) == 1 {print $2; found=1} END {if (!found) print 0}' <&3
  exec 3>&-
}

run_store() { # name marks-toml conns token route-extra -> "rps p99 trips palisade-cpu% etcd-cpu% load-core-idle% steal% confirm-ms"
  local name=$1 marks=$2 c=$3 token=$4 extra=$5 pal adm out
  pal=$(free_port); adm=$(free_port)
  mkdir -p "$WORK/$name"
  cat >"$WORK/$name/palisade.toml" <<CONF
[proxy]
listen = "127.0.0.1:$pal"
workers = 1
[admin]
listen = "127.0.0.1:$adm"
$marks
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:$UP"
[[route]]
name = "bench"
upstream = "legacy"
path_prefix = "/"
resource = "bench-$name-$c"
$extra
CONF
  RUST_LOG=warn "${PROXY_CPU[@]}" "$BIN" run --config "$WORK/$name/palisade.toml" 2>"$WORK/$name.log" &
  local pid=$!
  wait_port "$pal" "$WORK/$name.log"
  "${LOAD_CPU[@]}" wrk -t1 -c"$c" -d2s -H "x-fencing-token: $token" "http://127.0.0.1:$pal/orders/7" >/dev/null
  local a0 t0 p0
  a0=$(metric "$adm" 'palisade_requests_total{outcome="admitted",route="bench"}')
  t0=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="confirm",store="etcd"}')
  p0=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="persist",store="etcd"}')
  local s0; s0=$(metric "$adm" 'palisade_store_operation_duration_seconds_sum{op="confirm",store="etcd"}')
  local c0; c0=$(cpu_ticks "$pid")
  local e0; e0=$(cpu_ticks "$ETCD_PID"); local i0; i0=$(idle_ticks); local st0; st0=$(steal_ticks)
  out=$("${LOAD_CPU[@]}" wrk -t1 -c"$c" -d"${DURATION}s" --latency -H "x-fencing-token: $token" "http://127.0.0.1:$pal/orders/7")
  local a1 t1 p1
  a1=$(metric "$adm" 'palisade_requests_total{outcome="admitted",route="bench"}')
  t1=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="confirm",store="etcd"}')
  p1=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="persist",store="etcd"}')
  local s1; s1=$(metric "$adm" 'palisade_store_operation_duration_seconds_sum{op="confirm",store="etcd"}')
  local c1; c1=$(cpu_ticks "$pid")
  local e1; e1=$(cpu_ticks "$ETCD_PID"); local i1; i1=$(idle_ticks); local st1; st1=$(steal_ticks)
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if grep -q "Non-2xx" <<<"$out"; then echo "$name: non-2xx responses:" >&2; echo "$out" >&2; exit 1; fi
  local rps p99
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(p99_ms <<<"$out")
  echo "$rps $p99 $(awk -v a="$((a1 - a0))" -v t="$(awk -v x="$t1" -v y="$t0" -v p="$p1" -v q="$p0" 'BEGIN {print x - y + p - q}')" 'BEGIN {if (a > 0) printf "%.4f", t / a; else print "n/a"}') $(percent $((c1 - c0))) $(percent $((e1 - e0))) $(percent $((i1 - i0))) $(percent $((st1 - st0))) $(awk -v s="$s1" -v r="$s0" -v n="$t1" -v m="$t0" 'BEGIN {if (n > m) printf "%.3f", 1000 * (s - r) / (n - m); else print "-"}')"
}

FILE_MARKS=$'[marks]\nstore = "file"\npath = "marks.db"'
etcd_marks() { printf '[marks]\nstore = "etcd"\n[marks.etcd]\nendpoints = ["http://127.0.0.1:%s"]\nprefix = "/bench/"\nconsistency = "%s"\n' "$ETCD" "$1"; }

# The lock's epoch, as the client library writes it; its mod revision is the owner's token.
ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$ETCD" put /palisade/lock/bench-lock/epoch owner >/dev/null
EPOCH=$(ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$ETCD" get /palisade/lock/bench-lock/epoch -w json \
  | sed -n 's/.*"mod_revision":\([0-9]*\).*/\1/p')

median() { tr ' ' '\n' | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

echo "palisade mark stores: $(nproc) cores ($PIN), wrk -t1, ${DURATION}s per run, one replica, median of $REPEAT"
printf "%-5s | %-6s | %-12s | %8s | %7s | %8s | %8s | %9s | %6s | %10s | %s\n" conns build store rps "p99 ms" \
  "palisade" "etcd" "load idle" "steal" "confirm ms" "etcd round trips / admitted"
for c in $CONNS; do
  declare -A RPS
  for build in "${BUILDS[@]}"; do
    label=${build%%:*} BIN=${build#*:}
    for store in file linearizable lock cached lock-cached; do
      token=5 extra=""
      case $store in
        file) marks=$FILE_MARKS ;;
        lock) marks=$(etcd_marks linearizable); token=$EPOCH; extra='lock = "bench-lock"' ;;
        lock-cached) marks=$(etcd_marks cached); token=$EPOCH; extra='lock = "bench-lock"' ;;
        *) marks=$(etcd_marks "$store") ;;
      esac
      runs=()
      for _ in $(seq "$REPEAT"); do runs+=("$(run_store "$store" "$marks" "$c" "$token" "$extra")"); done
      rps=$(for r in "${runs[@]}"; do echo "${r%% *}"; done | tr '\n' ' ' | median)
      # The other columns are the median run's.
      for r in "${runs[@]}"; do [[ ${r%% *} == "$rps" ]] && { line=$r; break; }; done
      read -r rps p99 trips pcpu ecpu idle steal readms <<<"$line"
      RPS[$label.$store]=$rps
      [[ $store == file ]] && trips="0 (local)"
      printf "%-5s | %-6s | %-12s | %8.0f | %7.2f | %7s%% | %7s%% | %8s%% | %5s%% | %10s | %s\n" \
        "$c" "$label" "$store" "$rps" "$p99" "$pcpu" "$ecpu" "$idle" "$steal" "$readms" "$trips"
    done
  done
  for build in "${BUILDS[@]}"; do
    label=${build%%:*}
    awk -v b="$label" -v f="${RPS[$label.file]}" -v l="${RPS[$label.linearizable]}" -v k="${RPS[$label.cached]}" \
      -v o="${RPS[$label.lock]}" -v q="${RPS[$label.lock-cached]}" \
      'BEGIN {printf "      %-6s linearizable/file %.2fx, cached/file %.2fx, lock/linearizable %.2fx, lock-cached/cached %.2fx\n", b, l/f, k/f, o/l, q/k}'
  done
done
