# Shared by benches/load.sh and benches/replicas.sh (sourced, not run).

# need CMD PACKAGE...: installs the Debian packages of missing commands when root, else exits
# with the apt-get line to run. Arguments come in pairs: command, package.
need() {
  local missing=()
  while (($#)); do
    command -v "$1" >/dev/null || [[ -x /usr/sbin/$1 ]] || missing+=("$2")
    shift 2
  done
  ((${#missing[@]})) || return 0
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing ${missing[*]}: sudo apt-get install -y ${missing[*]}" >&2; exit 1
  fi
}

# A loopback port nothing listens on, below the ephemeral range (where a port can be taken by
# the local end of a connection, which makes a later listen on it fail).
free_port() {
  local p low
  read -r low _ </proc/sys/net/ipv4/ip_local_port_range
  while :; do
    p=$((10000 + RANDOM % (low - 10000)))
    (echo >/dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo $p; return; }
  done
}

# Waits (10 s at most) until something listens on port $1; on failure prints the log file $2
# (the server's) when given.
wait_port() {
  for _ in $(seq 200); do (echo >/dev/tcp/127.0.0.1/$1) 2>/dev/null && return; sleep 0.05; done
  echo "nothing listens on port $1" >&2
  [[ -n ${2:-} ]] && tail -20 "$2" >&2
  exit 1
}

# Pins the proxy under test to core 0 and the load (wrk, upstream, etcd) to core 1.
if (($(nproc) >= 2)); then
  PROXY_CPU=(taskset -c 0); LOAD_CPU=(taskset -c 1); PIN="proxy on core 0, load generator + upstream on core 1"
else
  PROXY_CPU=(); LOAD_CPU=(); PIN="one core: nothing pinned"
fi

# wrk's p99 latency in ms, from its --latency output on stdin.
p99_ms() {
  awk '$1=="99%" {v=$2; if (v ~ /us$/) {sub(/us$/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms$/,"",v)} else if (v ~ /s$/) {sub(/s$/,"",v); v*=1000}; print v}'
}

# upstream_conf FILE PORT [http2]: an nginx (1 worker) answering `200 ok` on PORT, the upstream
# every load script puts behind the proxies; with `http2`, over h2c.
upstream_conf() {
  local dir; dir=$(dirname "$1")
  cat >"$1" <<CONF
worker_processes 1;
pid $dir/upstream.pid;
error_log $dir/upstream.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  http2_max_concurrent_streams 1024;
  server { listen 127.0.0.1:$2 ${3:-reuseport}; location / { return 200 "ok\n"; } }
}
CONF
}

# palisade_conf FILE LISTEN ADMIN UPSTREAM_PORT [PROTOCOL] [EXTRA]: palisade with one worker,
# the file store and one guarded route "bench" (resource "bench") to the upstream; EXTRA is
# appended (e.g. an [access_log] table).
palisade_conf() {
  mkdir -p "$(dirname "$1")"
  cat >"$1" <<CONF
[proxy]
listen = "127.0.0.1:$2"
workers = 1
[admin]
listen = "127.0.0.1:$3"
[marks]
store = "file"
path = "marks.db"
[[upstream]]
name = "legacy"
url = "http://127.0.0.1:$4"
protocol = "${5:-http1}"
[[route]]
name = "bench"
upstream = "legacy"
path_prefix = "/"
resource = "bench"
${6:-}
CONF
}

# templated_conf FILE ENTITIES: turns the palisade_conf in FILE into one whose route takes its
# resource from the path (`path_pattern = "/w/{id}"`, `resource = "w/{id}"`, one mark per
# entity, room for ENTITIES cached and stored marks), seeds every entity's mark at 5 (a
# palisade 0.1 marks.json beside the configuration, migrated at start: the runs measure
# equal-token admissions, as on a fixed route) and writes entities.lua beside it, a wrk
# script that sends `/w/<n>` for n cycling over the entities from a random start.
templated_conf() {
  local dir
  dir=$(dirname "$1")
  sed -i -e '/^\[\[route\]\]$/,$d' -e "s/^\[marks\]$/[marks]\nmax_cached = $(($2 * 3 / 2))/" "$1"
  cat >>"$1" <<CONF
[[route]]
name = "bench"
upstream = "legacy"
path_pattern = "/w/{id}"
resource = "w/{id}"
max_marks = $(($2 * 2))
CONF
  awk -v n="$2" 'BEGIN {printf "{\"format\":\"palisade-marks/1\",\"marks\":{"; for (i = 0; i < n; i++) printf "%s\"w/%d\":5", (i ? "," : ""), i; print "}}"}' \
    >"$dir/marks.json"
  cat >"$dir/entities.lua" <<LUA
local n = math.random(0, $2 - 1)
request = function()
  n = (n + 1) % $2
  return wrk.format(nil, "/w/" .. n)
end
LUA
}

# open_entities PORT ENTITIES SCRIPT: sends every entity of a templated_conf palisade on PORT
# one request (each first use reads its mark from the store), with the wrk SCRIPT.
open_entities() {
  "${LOAD_CPU[@]}" wrk -t1 -c64 -d"$(($2 / 20000 + 2))s" -s "$3" -H 'x-fencing-token: 5' "http://127.0.0.1:$1/" >/dev/null
}

# The median of the numbers on stdin.
# Makes the run's scratch directory $WORK and kills every pid in $PIDS and removes $WORK when
# the script exits, however it exits.
work_dir() {
  WORK=$(mktemp -d)
  PIDS=()
  trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
}

median() { sort -g | awk '{v[NR]=$1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}'; }

# CPU clock ticks (user + system) process $1 has used; 0 without a pid.
cpu_ticks() { if [[ -n ${1:-} ]]; then awk '{print $14 + $15}' "/proc/$1/stat"; else echo 0; fi; }

# proxy_nginx_conf FILE PORT UPSTREAM_PORT CONNECTIONS UPSTREAM_KEEPALIVE: the reference
# reverse proxy (nginx, 1 worker) on PORT in front of UPSTREAM_PORT, with upstream keep-alive.
proxy_nginx_conf() {
  local dir; dir=$(dirname "$1")
  cat >"$1" <<CONF
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/nginx.err warn;
events { worker_connections $4; }
http {
  access_log off;
  keepalive_requests 1000000;
  upstream legacy { server 127.0.0.1:$3; $5 }
  server {
    listen 127.0.0.1:$2;
    location / {
      proxy_pass http://legacy;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
CONF
}
