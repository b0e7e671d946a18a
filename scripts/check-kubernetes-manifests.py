"""Checks a rendered overlay of deploy/kubernetes against the palisade.toml it ships.

    check-kubernetes-manifests.py sidecar|shared RENDERED.yaml

Run by scripts/check-kubernetes with its venv's Python (PyYAML comes with
kubernetes-validate; tomllib needs Python 3.11). The schema check says the manifests are
valid Kubernetes; this one says they fit palisade: the container ports are the [proxy] and
[admin] listen ports of the ConfigMap's palisade.toml, the probes ask /livez and /readyz on
the admin port, the Service targets palisade's listener, palisade writes only where a
writable volume is mounted, the grace period covers the drain. Prints every mismatch and
exits 1 if there is one.
"""

import ipaddress
import sys
import tomllib

import yaml

CONFIG_KEY = "palisade.toml"
TOKEN_ENV = "PALISADE_ADMIN_TOKEN"
ADMIN_DEFAULT = "127.0.0.1:9901"

problems = []


def fail(msg):
    problems.append(msg)


def split_addr(addr, key):
    """("0.0.0.0", 8080) from "0.0.0.0:8080" or "[::]:8080"."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        fail(f"{key} = {addr!r}: expected IP:port")
        return None, None
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        fail(f"{key} = {addr!r}: not an IP address")
        return None, int(port)
    return ip, int(port)


def only(items, what):
    if len(items) != 1:
        fail(f"expected exactly one {what}, found {len(items)}")
        return None
    return items[0]


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def sleep_seconds(container):
    pre = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre:
        return pre["sleep"]["seconds"]
    cmd = (pre.get("exec") or {}).get("command") or []
    if len(cmd) == 2 and cmd[0].endswith("sleep") and cmd[1].isdigit():
        return int(cmd[1])
    return 0


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode not in ("sidecar", "shared"):
        raise SystemExit("usage: check-kubernetes-manifests.py sidecar|shared RENDERED.yaml")
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    # The configuration: the one ConfigMap holding palisade.toml.
    cm = only([c for c in by_kind.get("ConfigMap", []) if CONFIG_KEY in c.get("data", {})],
              f"ConfigMap with {CONFIG_KEY}")
    dep = only(by_kind.get("Deployment", []), "Deployment")
    svc = only(by_kind.get("Service", []), "Service")
    if not (cm and dep and svc):
        return
    try:
        conf = tomllib.loads(cm["data"][CONFIG_KEY])
    except tomllib.TOMLDecodeError as e:
        fail(f"ConfigMap {cm['metadata']['name']}: {CONFIG_KEY} is not valid TOML: {e}")
        return
    where = f"ConfigMap {cm['metadata']['name']} {CONFIG_KEY}"

    pod = dep["spec"]["template"]["spec"]
    pod_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    inits = pod.get("initContainers", [])
    mains = pod.get("containers", [])
    pal = only([c for c in inits + mains if c["name"] == "palisade"], "container named palisade")
    if not pal:
        return
    others = [c for c in inits + mains if c is not pal]

    # Sidecar: a native sidecar (restartable init container); shared: a plain container.
    if mode == "sidecar":
        if pal not in inits or pal.get("restartPolicy") != "Always":
            fail("sidecar: palisade must be an initContainer with restartPolicy: Always")
        if not mains:
            fail("sidecar: no application container beside palisade")
        if dep["spec"].get("replicas", 1) != 1:
            fail("sidecar: a file mark store is one Pod's: replicas must be 1")
        if dep["spec"].get("strategy", {}).get("type") != "Recreate":
            fail("sidecar: strategy must be Recreate (one proxy per marks file)")
    else:
        if pal not in mains:
            fail("shared: palisade must be a regular container")
        if dep["spec"].get("replicas", 1) < 2:
            fail("shared: replicas must be 2 or more")

    # The configuration file palisade runs with is the ConfigMap's, mounted.
    args = pal.get("args", [])
    config_path = args[args.index("--config") + 1] if "--config" in args else None
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"].rstrip("/"): m for m in pal.get("volumeMounts", [])}
    cfg_dir, _, cfg_file = (config_path or "").rpartition("/")
    m = mounts.get(cfg_dir)
    if not config_path or cfg_file != CONFIG_KEY or not m:
        fail(f"palisade's args {args} do not name {CONFIG_KEY} in a mounted directory")
    elif (vols.get(m["name"], {}).get("configMap") or {}).get("name") != cm["metadata"]["name"]:
        fail(f"{cfg_dir} is not ConfigMap {cm['metadata']['name']}")

    # Ports: containerPorts `proxy` and `admin` are the listen ports, on all interfaces.
    ports = {p.get("name"): p["containerPort"] for p in pal.get("ports", [])}
    proxy_ip, proxy_port = split_addr(conf.get("proxy", {}).get("listen", ""), "[proxy] listen")
    admin = conf.get("admin", {})
    if admin.get("enabled", True) is not True:
        fail(f"{where}: [admin] enabled must be true (the probes use it)")
    admin_ip, admin_port = split_addr(admin.get("listen", ADMIN_DEFAULT), "[admin] listen")
    for key, ip in (("[proxy] listen", proxy_ip), ("[admin] listen", admin_ip)):
        if ip is not None and not ip.is_unspecified:
            fail(f"{where}: {key} is on {ip}: the Service and kubelet probes reach the Pod's "
                 "IP, so it must be 0.0.0.0 or [::]")
    if ports.get("proxy") != proxy_port:
        fail(f"containerPort `proxy` is {ports.get('proxy')}, [proxy] listen port {proxy_port}")
    if ports.get("admin") != admin_port:
        fail(f"containerPort `admin` is {ports.get('admin')}, [admin] listen port {admin_port}")
    for c in others:
        for p in c.get("ports", []):
            if p.get("name") in ("proxy", "admin") or p["containerPort"] in ports.values():
                fail(f"container {c['name']} declares port {p}, which is palisade's")

    def resolve(port):
        return ports.get(port) if isinstance(port, str) else port

    # Probes: liveness /livez, readiness /readyz, startup /readyz (sidecar: the application
    # starts only when palisade is ready) or /livez, all on the admin port.
    want = {"livenessProbe": {"/livez"}, "readinessProbe": {"/readyz"},
            "startupProbe": {"/readyz"} if mode == "sidecar" else {"/livez", "/readyz"}}
    for probe, paths in want.items():
        get = (pal.get(probe) or {}).get("httpGet")
        if not get:
            fail(f"palisade has no httpGet {probe}")
            continue
        if get.get("path") not in paths:
            fail(f"palisade {probe} asks {get.get('path')}, expected {' or '.join(sorted(paths))}")
        if resolve(get.get("port")) != admin_port:
            fail(f"palisade {probe} port {get.get('port')} is not the admin port {admin_port}")

    # The Service: selects this Pod and targets palisade's listener, not the application.
    if not matches(svc["spec"].get("selector"), pod_labels):
        fail(f"Service {svc['metadata']['name']} selector does not match the Pod's labels")
    for p in svc["spec"]["ports"]:
        if resolve(p.get("targetPort", p["port"])) != proxy_port:
            fail(f"Service port {p['port']} targets {p.get('targetPort')}, not palisade's "
                 f"[proxy] listen port {proxy_port}")

    # The admin token comes from a Secret under the name token_env gives.
    if admin.get("token_env") != TOKEN_ENV:
        fail(f"{where}: [admin] token_env must be {TOKEN_ENV!r}")
    env = {e["name"]: e for e in pal.get("env", [])}
    if "secretKeyRef" not in (env.get(TOKEN_ENV, {}).get("valueFrom") or {}):
        fail(f"palisade's env {TOKEN_ENV} does not come from a Secret")

    # Security context: the Pod's and every container's.
    psc = pod.get("securityContext", {})
    for k, v in (("runAsNonRoot", True), ("fsGroup", None), ("runAsUser", None)):
        if k not in psc or (v is not None and psc[k] != v):
            fail(f"Pod securityContext.{k} missing or wrong")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        fail("Pod seccompProfile must be RuntimeDefault")
    for c in inits + mains:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            fail(f"container {c['name']}: allowPrivilegeEscalation must be false")
        if sc.get("readOnlyRootFilesystem") is not True:
            fail(f"container {c['name']}: readOnlyRootFilesystem must be true")
        if (sc.get("capabilities") or {}).get("drop") != ["ALL"]:
            fail(f"container {c['name']}: capabilities must drop ALL")
        res = c.get("resources", {})
        if not res.get("requests"):
            fail(f"container {c['name']}: no resource requests")
        if mode == "sidecar" and not res.get("limits"):
            fail(f"container {c['name']}: no resource limits")

    # Marks: where palisade writes.
    marks = conf.get("marks", {})
    store = marks.get("store", "file")
    writable = {p: m for p, m in mounts.items() if not m.get("readOnly")}
    if mode == "sidecar":
        mpath = marks.get("path", "data/marks.db")
        mdir = mpath.rpartition("/")[0]
        if store != "file" or not mpath.startswith("/"):
            fail(f"{where}: expected store = \"file\" and an absolute path,"
                 f" got {store!r}, {mpath!r}")
        elif mdir not in writable:
            fail(f"[marks] path {mpath}: no writable volume is mounted at {mdir}")
        elif "persistentVolumeClaim" not in vols.get(writable[mdir]["name"], {}):
            fail(f"{mdir} is not a PersistentVolumeClaim: the marks would die with the Pod")
        else:
            claim = vols[writable[mdir]["name"]]["persistentVolumeClaim"]["claimName"]
            if claim not in [p["metadata"]["name"]
                             for p in by_kind.get("PersistentVolumeClaim", [])]:
                fail(f"PersistentVolumeClaim {claim} is not in the overlay")
        for u in conf.get("upstream", []):
            for url in [u.get("url")] + u.get("urls", []):
                if url and "//127.0.0.1:" not in url and "//localhost:" not in url:
                    fail(f"upstream {u['name']} {url}: the sidecar's application is on loopback")
    else:
        if store != "etcd" or not marks.get("etcd", {}).get("endpoints"):
            fail(f"{where}: expected store = \"etcd\" with [marks.etcd] endpoints")
        if writable:
            fail(f"palisade writes no file with marks in etcd, yet mounts {sorted(writable)}")
        pdb = only(by_kind.get("PodDisruptionBudget", []), "PodDisruptionBudget")
        if pdb and not matches(pdb["spec"]["selector"].get("matchLabels"), pod_labels):
            fail("PodDisruptionBudget selector does not match the Pod's labels")
        spread = pod.get("topologySpreadConstraints", [])
        aff = (pod.get("affinity") or {}).get("podAntiAffinity")
        if not spread and not aff:
            fail("shared: no topologySpreadConstraints or podAntiAffinity")
        for t in spread:
            if not matches(t["labelSelector"].get("matchLabels"), pod_labels):
                fail(f"topology spread on {t['topologyKey']} does not select the Pod")

    # Grace: every preStop sleep plus palisade's drain fits in the Pod's grace period.
    grace = pod.get("terminationGracePeriodSeconds", 30)
    drain = conf.get("proxy", {}).get("shutdown_grace_ms", 10000) / 1000
    need = sum(sleep_seconds(c) for c in inits + mains) + drain
    if grace < need:
        fail(f"terminationGracePeriodSeconds {grace} < preStop sleeps + shutdown_grace_ms "
             f"= {need:g} s")

    if not problems:
        print(f"ports proxy {proxy_port}, admin {admin_port}, probes, Service, "
              f"marks ({store}), security context and grace ({grace} s >= {need:g} s) "
              f"agree with {CONFIG_KEY}")


main()
for p in problems:
    print(f"{sys.argv[1]}: {p}", file=sys.stderr)
sys.exit(1 if problems else 0)
