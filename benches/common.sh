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

# A loopback port nothing listens on.
free_port() {
  local p
  while :; do
    p=$((20000 + RANDOM % 30000))
    (echo >/dev/tcp/127.0.0.1/$p) 2>/dev/null || { echo $p; return; }
  done
}

# Waits (10 s at most) until something listens on port $1.
wait_port() {
  for _ in $(seq 200); do (echo >/dev/tcp/127.0.0.1/$1) 2>/dev/null && return; sleep 0.05; done
  echo "nothing listens on port $1" >&2; exit 1
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
