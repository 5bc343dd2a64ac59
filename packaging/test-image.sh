#!/usr/bin/env bash
# The Kubernetes manifests and the OCI image, on this machine (no cluster, no registry):
#
# 1. `kubectl kustomize` (Debian 12's kubectl 1.20, kustomize v2.0.3, or newer) renders
#    deploy/kubernetes (the base), deploy/gke, and the CRD-based kustomizations beside the base
#    (prometheus-operator/, gke-managed-prometheus/), and `kubernetes-validate` (PyPI, in
#    target/k8s-venv) checks every object offline against the Kubernetes schemas, strictly
#    (unknown fields are errors), for the oldest and the newest Kubernetes it is asked for. Objects of CRDs it has no schema for (ServiceMonitor,
#    PrometheusRule, PodMonitoring) are listed as such; of those, the PrometheusRule's rules go
#    through `promtool check rules`, and every monitor's selector and port are checked against
#    the Service and the DaemonSet. A broken DaemonSet must fail the validation (the check checks).
# 2. packaging/build-image.sh builds the image, and podman runs it as the DaemonSet does: the
#    host's PID namespace (its /proc) and network, the host's cgroup tree, the socket and state
#    directories and the config directory from host paths (here: a scratch directory, so nothing
#    of the host's own /run/gpuguard is touched), capabilities KILL and NET_ADMIN only, no new
#    privileges, a read-only root, the DaemonSet's arguments (--watch-config). It guards a
#    process this script starts outside the container (the only one its [[model]] matches,
#    `candidates = "models"`): the process is stopped for its RAM budget, resumed when the config
#    in the mounted directory is replaced (no signal: --watch-config), stopped again under a lower
#    budget, and resumed by the daemon's clean stop (`podman stop`, SIGTERM, exit 0). NVML is
#    loaded as on GKE, from the driver's directory mounted at /usr/local/nvidia (here the fake
#    of tests/fake_nvml, built here): /readyz is 503 while its GPU is at the act floor, 200 once
#    it has room; /healthz answers on 127.0.0.1; `gpuguard status` run on the host reads the
#    daemon through the shared socket.
#
#   packaging/test-image.sh
#
# GPUGUARD_RELEASE_DIR: passed to build-image.sh (a release directory built already).
# GPUGUARD_K8S_VERSIONS (default "1.30.0 1.37.0"): the Kubernetes versions to validate against.
# Run by .ci/run, as root, on Debian 12 (podman 4.3 with runc: packaging/containers.conf). Needs
# podman, runc, debootstrap, kubectl (Debian's kubernetes-client), python3-venv, cc; promtool
# (Debian's prometheus, which scripts/test installs) for the rules.
# Signals only the process it starts; listens on 127.0.0.1 only.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
say() { echo "== test-image: $*"; }
fail() {
    echo "test-image: FAIL: $*" >&2
    exit 1
}
[ "$(id -u)" = 0 ] || fail "run as root (podman's storage, the host's PID namespace)"
for tool in podman runc kubectl python3; do
    command -v "$tool" >/dev/null || fail "$tool not found"
done
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/packaging/containers.conf}
WORK=$(mktemp -d /tmp/gpuguard-test-image.XXXXXX)
NAME=gpuguard-test-image-$$
HOG=
cleanup() {
    podman rm -f -t 0 "$NAME" >/dev/null 2>&1 || true
    if [ -n "$HOG" ]; then
        kill -CONT "$HOG" 2>/dev/null || true
        kill "$HOG" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# --- 1. the manifests --------------------------------------------------------------------------
say "kustomize and kubernetes-validate"
VENV=$PWD/target/k8s-venv
[ -x "$VENV/bin/kubernetes-validate" ] || {
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q kubernetes-validate
}
mkdir -p "$WORK/render"
echo "   kubectl $(kubectl version --client 2>/dev/null | grep -oE 'v[0-9]+\.[0-9]+\.[0-9]+' | head -n 1)"
render() { # DIR: kubectl kustomize DIR (later kustomizes warn of deprecated fields: not shown)
    kubectl kustomize "$1" 2>"$WORK/kustomize.err" || {
        cat "$WORK/kustomize.err" >&2
        fail "kubectl kustomize $1"
    }
}
render deploy/kubernetes >"$WORK/render/base.yaml"
render deploy/gke >"$WORK/render/gke.yaml"
# The base with the CRD-based kustomizations beside it: everything there is, together.
{
    cat "$WORK/render/base.yaml"
    for k in prometheus-operator gke-managed-prometheus; do
        echo ---
        render "deploy/kubernetes/$k"
    done
} >"$WORK/render/all.yaml"
for version in ${GPUGUARD_K8S_VERSIONS:-1.30.0 1.37.0}; do
    for f in base gke all; do
        "$VENV/bin/kubernetes-validate" --strict --quiet -k "$version" "$WORK/render/$f.yaml" \
            >"$WORK/validate.log" 2>&1 || {
            cat "$WORK/validate.log" >&2
            fail "deploy: $f fails validation against Kubernetes $version"
        }
        # What it could not validate (no schema): only the CRD kinds may be there.
        grep -o "Couldn't find schema for kind [A-Za-z]*" "$WORK/validate.log" |
            awk '{print $NF}' | sort -u >"$WORK/unvalidated" || true
        if grep -vxE 'ServiceMonitor|PrometheusRule|PodMonitoring' "$WORK/unvalidated"; then
            fail "deploy: $f has objects of kinds without a schema that are not the known CRDs"
        fi
    done
done
echo "   validated (strict) against Kubernetes ${GPUGUARD_K8S_VERSIONS:-1.30.0 1.37.0}:" \
    "$(grep -c '^kind:' "$WORK/render/all.yaml") objects, deploy/gke's $(grep -c '^kind:' "$WORK/render/gke.yaml")"
echo "   no schema (CRDs), checked below instead: $(tr '\n' ' ' <"$WORK/unvalidated")"
# The validation rejects what it should: a DaemonSet with a misspelt field.
sed 's/^  updateStrategy:/  updateStrategi:/' "$WORK/render/base.yaml" >"$WORK/render/broken.yaml"
if "$VENV/bin/kubernetes-validate" --strict --quiet -k 1.37.0 "$WORK/render/broken.yaml" \
    >/dev/null 2>&1; then
    fail "kubernetes-validate passed a DaemonSet with an unknown field"
fi
# The CRD objects: rules through promtool, monitors against the Service and the DaemonSet.
"$VENV/bin/python" - "$WORK/render/all.yaml" "$WORK/rules.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
def fail(msg):
    sys.exit(f"test-image: FAIL: deploy: {msg}")
svc, = by_kind["Service"]
ds, = by_kind["DaemonSet"]
pod_labels = ds["spec"]["template"]["metadata"]["labels"]
container, = ds["spec"]["template"]["spec"]["containers"]
ports = {p["name"] for p in container["ports"]}
for kind, labels in (("ServiceMonitor", svc["metadata"]["labels"]), ("PodMonitoring", pod_labels)):
    for m in by_kind.get(kind, []):
        want = m["spec"]["selector"]["matchLabels"]
        if any(labels.get(k) != v for k, v in want.items()):
            fail(f"{kind} {m['metadata']['name']} selects {want}, which is not {labels}")
        for e in m["spec"]["endpoints"]:
            if e["port"] not in ports | {p["name"] for p in svc["spec"]["ports"]}:
                fail(f"{kind} endpoint port {e['port']} is not the DaemonSet's {ports}")
        if m["metadata"].get("namespace") != ds["metadata"]["namespace"]:
            fail(f"{kind} is not in the DaemonSet's namespace")
rule, = by_kind["PrometheusRule"]
yaml.safe_dump(rule["spec"], open(sys.argv[2], "w"))
EOF
if command -v promtool >/dev/null; then
    promtool check rules "$WORK/rules.yaml" >"$WORK/promtool.log" 2>&1 || {
        cat "$WORK/promtool.log" >&2
        fail "deploy: the PrometheusRule's rules fail promtool check rules"
    }
    echo "   PrometheusRule: $(grep -o 'SUCCESS: [0-9]* rules found' "$WORK/promtool.log")"
else
    echo "   PrometheusRule: promtool not found (apt-get install prometheus): rules not checked"
fi
# Every series the rules name is one gpuguard exports (src/metrics/).
grep -oE 'gpuguard_[a-z0-9_]+' "$WORK/rules.yaml" | sort -u | while read -r series; do
    base=${series%_total}
    grep -rqE "\"$base\"" src/metrics/ || fail "deploy: the rules name $series, which gpuguard does not export"
done

# --- 2. the image under podman, as the DaemonSet runs it ---------------------------------------
say "build the image"
t0=$(date +%s)
IMAGE=$(packaging/build-image.sh "$WORK/image" | tail -n 1)
echo "   $IMAGE in $(($(date +%s) - t0)) s, $(du -m "$WORK"/image/*.tar | cut -f1) MiB as a tar"
[ "$(podman image inspect --format '{{json .Config.Entrypoint}}' "$IMAGE")" = \
    '["/usr/bin/gpuguard","daemon","--config","/etc/gpuguard/config.toml"]' ] ||
    fail "the image's entrypoint is $(podman image inspect --format '{{json .Config.Entrypoint}}' "$IMAGE")"
[ "$(podman image inspect --format '{{.Config.User}}' "$IMAGE")" = 0:0 ] ||
    fail "the image's user is not 0:0"
# The host's gpuguard for `status` through the socket: the binary the image has.
podman create --name "$NAME-copy" "$IMAGE" >/dev/null
podman cp "$NAME-copy:/usr/bin/gpuguard" "$WORK/gpuguard"
podman rm "$NAME-copy" >/dev/null
"$WORK/gpuguard" check-config --portable deploy/kubernetes/config.toml >/dev/null ||
    fail "deploy/kubernetes/config.toml fails check-config --portable"

say "run it as the DaemonSet does, guarding a process outside the container"
mkdir -p "$WORK/etc" "$WORK/run" "$WORK/state" "$WORK/nvidia/lib64"
chmod 0755 "$WORK/run"
chmod 0700 "$WORK/state"
TOKEN=gpuguard-test-image-$$-$RANDOM
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
config() { # BUDGET: the config, replaced whole in the mounted directory (as a ConfigMap is)
    cat >"$WORK/etc/.config.toml.new" <<EOF
[daemon]
state_dir = "/var/lib/gpuguard"
candidates = "models"
interval = "200ms"
scan_interval = "200ms"
[ram]
warn_available = "0%"
min_available = "0%"
[gpu]
min_free = "2GiB"
sample_timeout = "500ms"
[launch]
socket = "/run/gpuguard/gpuguard.sock"
[metrics]
listen = "127.0.0.1:$PORT"
[history]
kernel_log = "off"
[[model]]
name = "outside"
match = { cmdline = "$TOKEN" }
ram = "$1"
action = "stop"
grace = "0s"
EOF
    mv "$WORK/etc/.config.toml.new" "$WORK/etc/config.toml"
}
# NVML as on GKE: the driver's directory mounted at /usr/local/nvidia, found through the image's
# LD_LIBRARY_PATH. Here the scripted fake (tests/fake_nvml), one GPU with 1 GiB free: at its
# act floor (min_free 2 GiB), so /readyz says not ready until it has room.
command -v cc >/dev/null || fail "cc not found (apt-get install gcc): the fake NVML is built here"
cc -shared -fPIC -O2 -pthread -Wl,-soname,libnvidia-ml.so.1 -o "$WORK/nvidia/lib64/libnvidia-ml.so.1" \
    tests/fake_nvml/fake_nvml.c
gpus() { # USED_GIB: GPU 0's state, replaced whole (the fake re-reads it when it changes)
    echo "device 0 name=\"Fake H100\" uuid=GPU-test-image total=$((16 << 30)) used=$(($1 << 30)) util=5" \
        >"$WORK/nvidia/.state.new"
    mv "$WORK/nvidia/.state.new" "$WORK/nvidia/state"
}
gpus 15
config 16MiB
# The process to guard: 64 MiB touched, then idle; its command line carries the token.
python3 -c 'import sys, time; b = b"x" * (64 << 20); time.sleep(600)' "$TOKEN" &
HOG=$!
state() { awk '{print $3}' "/proc/$HOG/stat" 2>/dev/null; }
stopped() { [ "$(state)" = T ]; }
running() { case $(state) in R | S | D) true ;; *) false ;; esac; }
wait_for() { # WHAT SECONDS COMMAND...: until COMMAND succeeds
    local what=$1 seconds=$2
    shift 2
    local end=$(($(date +%s) + seconds))
    until "$@"; do
        if [ "$(date +%s)" -ge "$end" ]; then
            podman logs "$NAME" 2>&1 | tail -n 40 >&2 || true
            fail "$what"
        fi
        sleep 0.2
    done
}
probe() { # PATH: "CODE BODY" of GET 127.0.0.1:$PORT/PATH
    python3 - "$PORT" "$1" <<'EOF'
import sys, urllib.request, urllib.error
try:
    r = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}{sys.argv[2]}", timeout=5)
    print(r.status, r.read().decode().strip())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode().strip())
except OSError as e:
    print(0, e)
EOF
}
answers() { probe "$1" | grep -q "^$2 $3"; }
t0=$(date +%s)
podman --runtime runc run -d --name "$NAME" \
    --pid=host --network=host \
    --cap-drop=all --cap-add=KILL --cap-add=NET_ADMIN \
    --security-opt=no-new-privileges --read-only --tmpfs /tmp \
    -v /sys/fs/cgroup:/sys/fs/cgroup \
    -v "$WORK/etc:/etc/gpuguard:ro" -v "$WORK/run:/run/gpuguard" -v "$WORK/state:/var/lib/gpuguard" \
    -v "$WORK/nvidia:/usr/local/nvidia:ro" -e FAKE_NVML_STATE=/usr/local/nvidia/state \
    -e GPUGUARD_LOG=info \
    "$IMAGE" --state-dir /var/lib/gpuguard --watch-config 1s >/dev/null
wait_for "no /healthz on 127.0.0.1:$PORT" 30 answers /healthz 200 "ok: the loop ticked"
echo "   healthz: $(probe /healthz)"
wait_for "/readyz does not name GPU 0 at its act floor" 10 \
    answers /readyz 503 "not ready: GPU 0 at the act floor"
echo "   readyz: $(probe /readyz)"
gpus 6
wait_for "/readyz is not ready once GPU 0 has room" 10 answers /readyz 200 "ready: guarding (mode enforce)"
echo "   readyz: $(probe /readyz)"
wait_for "the process outside the container was not stopped for its budget" 30 \
    stopped
echo "   pid $HOG stopped for its RAM budget (16 MiB), $(($(date +%s) - t0)) s after podman run"
"$WORK/gpuguard" status --socket "$WORK/run/gpuguard.sock" >"$WORK/status.txt" ||
    fail "gpuguard status through the shared socket: $(cat "$WORK/status.txt")"
grep -q "outside" "$WORK/status.txt" && grep -q "$HOG" "$WORK/status.txt" &&
    grep -q "Fake H100" "$WORK/status.txt" ||
    fail "status from the host does not show the model, its process and the GPU: $(cat "$WORK/status.txt")"
echo "   gpuguard status on the host, through $WORK/run/gpuguard.sock: the model, pid $HOG," \
    "and GPU 0 read through NVML from the mounted /usr/local/nvidia/lib64"
config 4GiB
wait_for "not resumed after the budget was raised in the mounted config" 30 running
echo "   resumed once the mounted config raised the budget (no signal: --watch-config)"
config 16MiB
wait_for "not stopped again under the lowered budget" 30 stopped
t0=$(date +%s)
podman stop -t 30 "$NAME" >/dev/null
code=$(podman inspect --format '{{.State.ExitCode}}' "$NAME")
[ "$code" = 0 ] || {
    podman logs "$NAME" 2>&1 | tail -n 40 >&2
    fail "the daemon exited $code on SIGTERM (podman stop)"
}
running || fail "the daemon's clean stop left pid $HOG $(state) (not running)"
podman logs "$NAME" >"$WORK/daemon.log" 2>&1
grep -q "SIGTERM: resuming held processes and stopping" "$WORK/daemon.log" ||
    fail "the daemon's log does not say it stopped on SIGTERM: $(tail -n 20 "$WORK/daemon.log")"
echo "   podman stop: exit 0 in $(($(date +%s) - t0)) s, pid $HOG resumed first"
echo "test-image: passed in $(($(date +%s) - started)) s"
