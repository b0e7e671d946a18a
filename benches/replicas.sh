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
#
# Usage: benches/replicas.sh   (DURATION=5 CONNS="16 64" benches/replicas.sh to shorten)
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-10}
CONNS=${CONNS:-"64"}

source "benches/common.sh"
need nginx nginx wrk wrk etcd etcd-server etcdctl etcd-client protoc protobuf-compiler taskset util-linux
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

cargo build --release --quiet --features etcd --bin palisade
BIN=target/release/palisade



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
  --initial-cluster "bench=http://127.0.0.1:$PEER" --heartbeat-interval=10 --election-timeout=100 \
  >"$WORK/etcd.log" 2>&1 & PIDS+=($!)
wait_port "$UP"; wait_port "$ETCD"

metric() { # admin-port series -> value
  exec 3<>/dev/tcp/127.0.0.1/$1
  printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
  awk -v s="$2" 'index($0, s) == 1 {print $2; found=1} END {if (!found) print 0}' <&3
  exec 3>&-
}

run_store() { # name marks-toml conns token route-extra -> "rps p99 trips"
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
  wait_port "$pal"
  "${LOAD_CPU[@]}" wrk -t1 -c"$c" -d2s -H "x-fencing-token: $token" "http://127.0.0.1:$pal/orders/7" >/dev/null
  local a0 t0 p0
  a0=$(metric "$adm" 'palisade_requests_total{outcome="admitted",route="bench"}')
  t0=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="confirm",store="etcd"}')
  p0=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="persist",store="etcd"}')
  out=$("${LOAD_CPU[@]}" wrk -t1 -c"$c" -d"${DURATION}s" --latency -H "x-fencing-token: $token" "http://127.0.0.1:$pal/orders/7")
  local a1 t1 p1
  a1=$(metric "$adm" 'palisade_requests_total{outcome="admitted",route="bench"}')
  t1=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="confirm",store="etcd"}')
  p1=$(metric "$adm" 'palisade_store_operation_duration_seconds_count{op="persist",store="etcd"}')
  kill "$pid"; wait "$pid" 2>/dev/null || true
  if grep -q "Non-2xx" <<<"$out"; then echo "$name: non-2xx responses:" >&2; echo "$out" >&2; exit 1; fi
  local rps p99
  rps=$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")
  p99=$(p99_ms <<<"$out")
  echo "$rps $p99 $(awk -v a="$((a1 - a0))" -v t="$(awk -v x="$t1" -v y="$t0" -v p="$p1" -v q="$p0" 'BEGIN {print x - y + p - q}')" 'BEGIN {if (a > 0) printf "%.4f", t / a; else print "n/a"}')"
}

FILE_MARKS=$'[marks]\nstore = "file"\npath = "marks.db"'
etcd_marks() { printf '[marks]\nstore = "etcd"\n[marks.etcd]\nendpoints = ["http://127.0.0.1:%s"]\nprefix = "/bench/"\nconsistency = "%s"\n' "$ETCD" "$1"; }

# The lock's epoch, as the client library writes it; its mod revision is the owner's token.
ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$ETCD" put /palisade/lock/bench-lock/epoch owner >/dev/null
EPOCH=$(ETCDCTL_API=3 etcdctl --endpoints "http://127.0.0.1:$ETCD" get /palisade/lock/bench-lock/epoch -w json \
  | sed -n 's/.*"mod_revision":\([0-9]*\).*/\1/p')

echo "palisade mark stores: $(nproc) cores, wrk -t1, ${DURATION}s per run, one replica"
printf "%-6s | %-14s | %12s | %9s | %s\n" conns store "rps" "p99 ms" "etcd round trips / admitted"
for c in $CONNS; do
  declare -A RPS
  for store in file linearizable lock cached lock-cached; do
    token=5 extra=""
    case $store in
      file) marks=$FILE_MARKS ;;
      lock) marks=$(etcd_marks linearizable); token=$EPOCH; extra='lock = "bench-lock"' ;;
      lock-cached) marks=$(etcd_marks cached); token=$EPOCH; extra='lock = "bench-lock"' ;;
      *) marks=$(etcd_marks "$store") ;;
    esac
    read -r rps p99 trips < <(run_store "$store" "$marks" "$c" "$token" "$extra")
    RPS[$store]=$rps
    [[ $store == file ]] && trips="0 (local)"
    printf "%-6s | %-14s | %12.0f | %9.2f | %s\n" "$c" "$store" "$rps" "$p99" "$trips"
  done
  awk -v f="${RPS[file]}" -v l="${RPS[linearizable]}" -v k="${RPS[cached]}" -v o="${RPS[lock]}" -v q="${RPS[lock-cached]}" \
    'BEGIN {printf "       linearizable/file %.2fx, cached/file %.2fx, lock/linearizable %.2fx, lock-cached/cached %.2fx\n", l/f, k/f, o/l, q/k}'
done
