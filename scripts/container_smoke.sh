#!/usr/bin/env bash
# The Dockerfile's runtime stage, proven on a clean Debian root where no container runtime runs
# (this sandbox: Podman installs from Debian, but no image registry is reachable and crun may not
# set its rlimits). Usage, as root:
#
#   debootstrap --variant=minbase --include=libgomp1,curl,ca-certificates bookworm /tmp/kylin-root
#   bash scripts/container_smoke.sh /tmp/kylin-root [MODEL_DIR]
#
# In the root it does what the runtime stage does (the non-root user 10001, the binary in
# /usr/local/bin), mounts MODEL_DIR read-only at /models/model, starts `kylin serve` as user
# 10001, waits for the HEALTHCHECK's command to pass, completes a prompt, and stops the server
# with SIGTERM (it must exit 0). What it does not prove: the build stage (the binary is the host's
# `target/release/kylin`, not the x86-64-v3 build) and the container's own isolation.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RFS="$(cd "${1:?usage: container_smoke.sh DEBIAN_ROOT [MODEL_DIR]}" && pwd)"
MODEL="${2:-${KYLIN_MODELS:-$HOME/.cache/kylin-models}/smollm2-135m-instruct}"
KYLIN="${KYLIN_BIN:-$ROOT/target/release/kylin}"
PORT="${PORT:-18080}"

chroot "$RFS" sh -c 'id -u kylin >/dev/null 2>&1 || useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kylin'
install -m 755 "$KYLIN" "$RFS/usr/local/bin/kylin"
mkdir -p "$RFS/models/model" "$RFS/proc" "$RFS/sys"
cleanup() {
  [ -n "${SERVER:-}" ] && kill -TERM "$SERVER" 2>/dev/null || true
  umount "$RFS/models/model" 2>/dev/null || true
  umount "$RFS/proc" 2>/dev/null || true
  umount "$RFS/sys" 2>/dev/null || true
}
trap cleanup EXIT
mount --bind "$MODEL" "$RFS/models/model"
mount -o remount,bind,ro "$RFS/models/model"
mount -t proc proc "$RFS/proc"
mount --bind /sys "$RFS/sys"

# The image's user cannot write the model.
if chroot --userspec=10001:10001 "$RFS" sh -c 'touch /models/model/x' 2>/dev/null; then
  echo "the model mount is writable" >&2; exit 1
fi
chroot --userspec=10001:10001 "$RFS" /usr/local/bin/kylin serve /models/model --host 127.0.0.1 --port "$PORT" \
  > "${TMPDIR:-/tmp}/kylin-container-smoke.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
  # The HEALTHCHECK's command, run inside the root.
  if chroot --userspec=10001:10001 "$RFS" curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { cat "${TMPDIR:-/tmp}/kylin-container-smoke.log" >&2; exit 1; }
  sleep 0.5
done
chroot --userspec=10001:10001 "$RFS" curl -fsS "http://127.0.0.1:$PORT/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
echo
ps -o user=,args= -p "$SERVER" | sed 's/^/server process: /'
kill -TERM "$SERVER"
wait "$SERVER"
echo "kylin serve stopped with status $? after SIGTERM"
SERVER=
