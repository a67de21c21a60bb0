#!/usr/bin/env bash
# A two-node Ray cluster on this machine: a head node carrying the custom resource
# {"node_policy": 1} and a worker node carrying {"node_gen": 1}, started with
# --node-ip-address=127.0.0.1 (Ray resolves it to the machine's routable address for a
# multi-node cluster, so the nodes are reachable there, behind the token), explicit ports,
# their own temp dirs and token authentication (RAY_AUTH_MODE=token, a random
# token in $DIR/auth_token, mode 0600). Each `ray start --block` runs in its own process group
# and is stopped by its PID (never `ray stop`: that kills every Ray on the machine).
#
#   .ci/scaleout/ray_two_nodes.sh start    # prints RAY_ADDRESS=127.0.0.1:<port>; writes $DIR/env
#   source "$DIR/env"                       # RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH
#   nrl grpo --config configs/grpo_tiny.yaml cluster.ray.address=$RAY_ADDRESS \
#       'cluster.ray.policy_resources={node_policy: 1}' 'cluster.ray.generation_resources={node_gen: 1}'
#   .ci/scaleout/ray_two_nodes.sh status   # alive nodes and their resources
#   .ci/scaleout/ray_two_nodes.sh stop
#
# DIR is $NRL_RAY2_DIR (default /tmp/nrl-ray2-$USER). CPUs per node: $NRL_RAY2_CPUS (default 2,
# logical). Object store per node: $NRL_RAY2_STORE_BYTES (default 256 MB).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${NRL_RAY2_DIR:-/tmp/nrl-ray2-${USER:-$(id -un)}}"
CPUS="${NRL_RAY2_CPUS:-2}"
STORE="${NRL_RAY2_STORE_BYTES:-268435456}"
if [ -x "$REPO/.venv/bin/ray" ]; then BIN="$REPO/.venv/bin"; else BIN="$(dirname "$(command -v ray)")"; fi
PY="$BIN/python"

export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$DIR/auth_token" RAY_USAGE_STATS_ENABLED=0
# Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER on every platform: a value other than 1/true makes
# `ray start --address=...` abort ("Multi-node Ray clusters are not supported on Windows and
# OSX"), even on Linux, where its default is on. The project's local Ray sets it to 0 while it
# starts (loopback only); a pytest process once leaked it into this script and the worker node
# never joined. A second node is what this script is for, so it sets it.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

free_ports() {  # N distinct free TCP ports on 127.0.0.1
  "$PY" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
for s in socks: s.close()
EOF
}

wait_nodes() {  # wait until $1 nodes are alive (timeout $2 s); fail at once if a node's
  # `ray start --block` process has exited (its pid files follow as arguments)
  "$PY" - "$1" "$2" "$(cat "$DIR/address")" "${@:3}" <<'EOF'
import os, sys, time, ray
want, timeout, addr, pidfiles = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]
ray.init(address=addr, log_to_driver=False, logging_level="ERROR")
deadline = time.monotonic() + timeout
while True:
    n = len([x for x in ray.nodes() if x.get("Alive")])
    if n >= want:
        break
    for f in pidfiles:
        pid = int(open(f).read())
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit(f"{os.path.basename(f)[:-4]} node (pid {pid}) exited; {n} of {want} Ray nodes alive")
    if time.monotonic() > deadline:
        sys.exit(f"only {n} of {want} Ray nodes alive after {timeout:g} s")
    time.sleep(0.5)
EOF
}

start_node() {  # name, extra args...
  local name="$1"; shift
  mkdir -p "$DIR/$name"
  # setsid: its own process group, so `stop` can reach the whole node (and only it) by PID
  setsid "$BIN/ray" start --block --node-ip-address=127.0.0.1 --num-cpus="$CPUS" \
    --object-store-memory="$STORE" --temp-dir="$DIR/$name" --disable-usage-stats "$@" \
    >"$DIR/$name.log" 2>&1 </dev/null &
  echo $! >"$DIR/$name.pid"
}

wait_port() {  # port, pidfile, timeout
  local t=0
  until "$PY" -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close()" "$1" 2>/dev/null; do
    alive "$2" || { echo "ray node exited early; log:" >&2; tail -30 "${2%.pid}.log" >&2; return 1; }
    t=$((t + 1)); [ "$t" -gt "$(( $3 * 2 ))" ] && { echo "port $1 not open after $3 s" >&2; return 1; }
    sleep 0.5
  done
}

cmd_start() {
  if alive "$DIR/head.pid" || alive "$DIR/worker.pid"; then
    echo "already running: RAY_ADDRESS=$(cat "$DIR/address")"; return 0
  fi
  mkdir -p "$DIR"; chmod 700 "$DIR"
  if [ ! -s "$DIR/auth_token" ]; then
    (umask 077; "$PY" -c "import secrets; print(secrets.token_hex(32))" >"$DIR/auth_token")
  fi
  read -r GCS H_NM H_OM H_AL H_AG H_RE H_ME H_DP W_NM W_OM W_AL W_AG W_RE W_ME <<<"$(free_ports 14)"
  echo "127.0.0.1:$GCS" >"$DIR/address"
  start_node head --head --port="$GCS" \
    --include-dashboard=false --dashboard-port="$H_DP" --dashboard-host=127.0.0.1 \
    --node-manager-port="$H_NM" --object-manager-port="$H_OM" \
    --dashboard-agent-listen-port="$H_AL" --dashboard-agent-grpc-port="$H_AG" \
    --runtime-env-agent-port="$H_RE" --metrics-export-port="$H_ME" \
    --resources='{"node_policy": 1}'
  wait_port "$GCS" "$DIR/head.pid" 120
  start_node worker --address="127.0.0.1:$GCS" \
    --node-manager-port="$W_NM" --object-manager-port="$W_OM" \
    --dashboard-agent-listen-port="$W_AL" --dashboard-agent-grpc-port="$W_AG" \
    --runtime-env-agent-port="$W_RE" --metrics-export-port="$W_ME" \
    --resources='{"node_gen": 1}'
  wait_nodes 2 180 "$DIR/head.pid" "$DIR/worker.pid" || {
    for n in worker head; do echo "--- $n node log (tail):" >&2; tail -20 "$DIR/$n.log" >&2 || true; done
    return 1
  }
  cat >"$DIR/env" <<EOF
export RAY_ADDRESS=127.0.0.1:$GCS
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$DIR/auth_token
export RAY_USAGE_STATS_ENABLED=0
EOF
  echo "RAY_ADDRESS=127.0.0.1:$GCS"
  echo "env: source $DIR/env   (head pid $(cat "$DIR/head.pid"), worker pid $(cat "$DIR/worker.pid"))"
}

stop_pid() {  # pidfile: SIGTERM the node (its `ray start` process and everything under it:
  # raylet, GCS, agents, Ray workers), SIGKILL what is left after 40 s. Only these PIDs.
  "$PY" "$HERE/stop_tree.py" "$1" 40
}

cmd_stop() {
  stop_pid "$DIR/worker.pid"
  stop_pid "$DIR/head.pid"
  rm -f "$DIR/env" "$DIR/address"
  echo "stopped"
}

cmd_status() {
  if ! alive "$DIR/head.pid"; then echo "not running"; return 1; fi
  echo "RAY_ADDRESS=$(cat "$DIR/address")"
  "$PY" - "$(cat "$DIR/address")" <<'EOF'
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
for n in ray.nodes():
    if n.get("Alive"):
        res = {k: v for k, v in n["Resources"].items() if not k.startswith("node:") and k != "object_store_memory"}
        print(f"node {n['NodeID'][:12]} {n['NodeManagerAddress']} head={n.get('IsHead', '?')} {res}")
EOF
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status   (state in \$NRL_RAY2_DIR, default $DIR)" >&2; exit 2 ;;
esac
