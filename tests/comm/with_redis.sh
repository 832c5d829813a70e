#!/usr/bin/env bash
# Runs a command against a private redis-server: starts one on a free local port (no persistence)
# that wants a fresh password, replaces the argument {redis} with its URL (redis://127.0.0.1:PORT),
# runs the command with the password in TESSERA_REDIS_PASSWORD, and stops the server whatever
# happens. Exits 77 (skipped) when redis-server is not installed.
set -euo pipefail
server=$(command -v redis-server || true)
if [[ -z "$server" ]]; then
  echo "with_redis.sh: redis-server not found (apt-get install redis-server); skipping" >&2
  exit 77
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
password=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
# The password in a file the server reads, not on its command line (which ps shows).
printf 'requirepass %s\n' "$password" > "$dir/redis.conf"
"$server" "$dir/redis.conf" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$dir" --daemonize no \
  >"$dir/redis.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
# Wait until it accepts connections (it takes a few milliseconds).
for _ in $(seq 100); do
  if python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 0.2)" 2>/dev/null; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then cat "$dir/redis.log" >&2; echo "with_redis.sh: redis-server died" >&2; exit 1; fi
  sleep 0.05
done
args=()
for a in "$@"; do args+=("${a//\{redis\}/redis://127.0.0.1:$port}"); done
TESSERA_REDIS_PASSWORD=$password "${args[@]}"
