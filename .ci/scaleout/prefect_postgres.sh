#!/usr/bin/env bash
# A Prefect server backed by PostgreSQL, a process work pool and a worker, all on 127.0.0.1:
#
#   .ci/scaleout/prefect_postgres.sh start   # PostgreSQL (Debian's package) in $DIR/pg on a free
#                                            # port, database `prefect`; `prefect server start`;
#                                            # work pool `local` (process); `prefect deploy --all`
#                                            # from prefect.yaml; `prefect worker start --pool local`
#   source "$DIR/env"                        # PREFECT_API_URL, PREFECT_HOME, NRL_REPO_DIR
#   prefect deployment run grpo/grpo-train -p config=configs/grpo_tiny.yaml --watch
#   prefect deployment run eval-sweep/eval-sweep -p target=$PWD/runs --watch
#   .ci/scaleout/prefect_postgres.sh status
#   .ci/scaleout/prefect_postgres.sh stop    # worker, server, then PostgreSQL, each by its PID
#
# DIR is $NRL_PREFECT_PG_DIR (default /tmp/nrl-prefect-pg-$USER). PostgreSQL refuses to run as
# root: as root the cluster belongs to the `postgres` system user. The database password is
# random (in $DIR/db_password, mode 0600) and is never printed; the connection URL lives only
# in the server's environment and in $DIR/server.env (0600). The UI is at
# http://127.0.0.1:<port>/ (PREFECT_SERVER_UI_API_URL points it at this port).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${NRL_PREFECT_PG_DIR:-/tmp/nrl-prefect-pg-${USER:-$(id -un)}}"
if [ -x "$REPO/.venv/bin/prefect" ]; then BIN="$REPO/.venv/bin"; else BIN="$(dirname "$(command -v prefect)")"; fi
PY="$BIN/python"
PGDATA="$DIR/pg/data"

export PREFECT_HOME="$DIR/prefect-home" PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export NRL_REPO_DIR="$REPO"

pg_bin() {
  local d
  d="$(pg_config --bindir 2>/dev/null || true)"
  [ -n "$d" ] && [ -x "$d/initdb" ] && { echo "$d"; return; }
  d="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)"
  [ -n "$d" ] && [ -x "$d/initdb" ] && { echo "$d"; return; }
  return 1
}

ensure_postgres() {
  if ! pg_bin >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null
    else
      echo "PostgreSQL not found: apt-get install -y postgresql" >&2; exit 1
    fi
  fi
  PGBIN="$(pg_bin)"
}

as_pg() {  # run a PostgreSQL program as a non-root user
  # (from a directory it can read: pg_ctl complains about an unreadable working directory)
  if [ "$(id -u)" = 0 ]; then (cd "$DIR/pg" && runuser -u postgres -- "$@"); else "$@"; fi
}

free_port() { "$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

alive() { [ -f "$1" ] && kill -0 "$(head -1 "$1")" 2>/dev/null; }

wait_http() {  # url, pidfile, timeout_s
  "$PY" - "$@" <<'EOF'
import os, sys, time, urllib.request
url, pid_file, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
pid = int(open(pid_file).read().split()[0])
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit(f"process {pid} exited before {url} answered")
    try:
        urllib.request.urlopen(url, timeout=2).close()
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(f"{url} did not answer within {timeout:g} s")
EOF
}

start_postgres() {
  ensure_postgres
  mkdir -p "$DIR/pg"
  [ "$(id -u)" = 0 ] && chown postgres: "$DIR/pg"
  chmod 700 "$DIR/pg"
  if [ ! -s "$DIR/db_password" ]; then
    (umask 077; "$PY" -c "import secrets; print(secrets.token_urlsafe(24))" >"$DIR/db_password")
  fi
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    local pw="$DIR/pg/pwfile"
    (umask 077; cp "$DIR/db_password" "$pw")
    [ "$(id -u)" = 0 ] && chown postgres: "$pw"
    as_pg "$PGBIN/initdb" -D "$PGDATA" -U nrl --pwfile="$pw" -A scram-sha-256 -E UTF8 --no-locale >"$DIR/initdb.log" 2>&1
    rm -f "$pw"
  fi
  PGPORT="$(free_port)"
  # TCP on 127.0.0.1 only; the unix socket in the cluster's own (0700) directory
  as_pg "$PGBIN/pg_ctl" -D "$PGDATA" -l "$DIR/pg/postgres.log" -w -t 180 \
    -o "-h 127.0.0.1 -p $PGPORT -k $DIR/pg" start >/dev/null
  echo "$PGPORT" >"$DIR/pg_port"
  PGPASSWORD="$(cat "$DIR/db_password")" "$PGBIN/psql" -h 127.0.0.1 -p "$PGPORT" -U nrl -d postgres -tAq \
    -c "SELECT 1 FROM pg_database WHERE datname = 'prefect'" | grep -q 1 \
    || PGPASSWORD="$(cat "$DIR/db_password")" "$PGBIN/createdb" -h 127.0.0.1 -p "$PGPORT" -U nrl prefect
}

start_server() {
  local port; port="$(free_port)"
  (umask 077; cat >"$DIR/server.env" <<EOF
PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://nrl:$(cat "$DIR/db_password")@127.0.0.1:$(cat "$DIR/pg_port")/prefect
EOF
  )
  mkdir -p "$PREFECT_HOME"
  # the connection URL goes through the environment only (never on a command line or in a log)
  env $(cat "$DIR/server.env") PREFECT_SERVER_UI_API_URL="http://127.0.0.1:$port/api" \
    setsid "$BIN/prefect" server start --host 127.0.0.1 --port "$port" \
    >"$DIR/server.log" 2>&1 </dev/null &
  echo $! >"$DIR/server.pid"
  echo "$port" >"$DIR/server_port"
  wait_http "http://127.0.0.1:$port/api/health" "$DIR/server.pid" 300
  cat >"$DIR/env" <<EOF
export PREFECT_API_URL=http://127.0.0.1:$port/api
export PREFECT_HOME=$PREFECT_HOME
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=1
export NRL_REPO_DIR=$REPO
EOF
}

start_worker() {
  # flow runs start in the worker's directory: the repository (prefect.yaml's pull step says so too)
  cd "$REPO"
  PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-3}" \
    setsid "$BIN/prefect" worker start --pool local --name "nrl-local-$$" \
    >"$DIR/worker.log" 2>&1 </dev/null &
  echo $! >"$DIR/worker.pid"
  local t=0
  until grep -q "started" "$DIR/worker.log" 2>/dev/null; do
    alive "$DIR/worker.pid" || { echo "worker exited:" >&2; tail -30 "$DIR/worker.log" >&2; return 1; }
    t=$((t + 1)); [ "$t" -gt 240 ] && { echo "worker did not start" >&2; return 1; }
    sleep 0.5
  done
}

cmd_start() {
  if alive "$DIR/server.pid"; then echo "already running: $(grep PREFECT_API_URL "$DIR/env")"; return 0; fi
  mkdir -p "$DIR"; chmod 711 "$DIR"
  start_postgres
  start_server
  # shellcheck disable=SC1091
  source "$DIR/env"
  "$BIN/prefect" work-pool create local --type process --overwrite >"$DIR/pool.log" 2>&1
  (cd "$REPO" && "$BIN/prefect" --no-prompt deploy --all) >"$DIR/deploy.log" 2>&1 \
    || { tail -40 "$DIR/deploy.log" >&2; return 1; }
  start_worker
  echo "PREFECT_API_URL=$PREFECT_API_URL"
  echo "UI: http://127.0.0.1:$(cat "$DIR/server_port")/   env: source $DIR/env"
  echo "pids: postgres $(head -1 "$PGDATA/postmaster.pid") server $(cat "$DIR/server.pid") worker $(cat "$DIR/worker.pid")"
}

cmd_stop() {
  "$PY" "$HERE/stop_tree.py" "$DIR/worker.pid" 30
  "$PY" "$HERE/stop_tree.py" "$DIR/server.pid" 30
  if [ -f "$PGDATA/postmaster.pid" ]; then
    # SIGINT = PostgreSQL's fast shutdown (the server has gone, no client is left)
    "$PY" "$HERE/stop_tree.py" "$PGDATA/postmaster.pid" 60 SIGINT
  fi
  rm -f "$DIR/env"
  echo "stopped"
}

cmd_status() {
  alive "$DIR/server.pid" || { echo "not running"; return 1; }
  # shellcheck disable=SC1091
  source "$DIR/env"
  echo "PREFECT_API_URL=$PREFECT_API_URL (server pid $(cat "$DIR/server.pid"))"
  echo "postgres pid $(head -1 "$PGDATA/postmaster.pid") on 127.0.0.1:$(cat "$DIR/pg_port"); worker pid $(cat "$DIR/worker.pid" 2>/dev/null || echo -)"
  "$BIN/prefect" deployment ls
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 start|stop|status   (state in \$NRL_PREFECT_PG_DIR, default $DIR)" >&2; exit 2 ;;
esac
