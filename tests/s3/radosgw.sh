#!/usr/bin/env bash
# radosgw.sh - start/stop a throw-away single-node Ceph cluster with radosgw
# (S3 API) for tests and CI.
#
# Usage:
#   tests/s3/radosgw.sh start DIR   # install packages if missing, build the
#                                   # cluster under DIR, start it, create an S3
#                                   # user, write DIR/env; fails in <~90 s
#   tests/s3/radosgw.sh env DIR     # print DIR/env as `export K=V` lines
#   tests/s3/radosgw.sh stop DIR    # kill exactly the daemons `start DIR`
#                                   # launched, wait for them, remove DIR
#   tests/s3/radosgw.sh status DIR  # exit 0 iff all daemons of DIR are alive
#
# Typical caller:
#   dir=$(mktemp -d /tmp/dcr-rgw.XXXXXX)
#   trap 'tests/s3/radosgw.sh stop "$dir"' EXIT
#   tests/s3/radosgw.sh start "$dir"
#   set -a; . "$dir/env"; set +a          # or: eval "$(radosgw.sh env "$dir")"
#   ... run tests against $DCR_S3_ENDPOINT ...
#
# DIR/env holds plain KEY=VALUE lines (no quoting needed, dotenv-compatible):
#   DCR_S3_ENDPOINT=http://127.0.0.1:PORT   use path-style addressing
#                 (virtual-hosted also works, as Host: BUCKET.localhost:PORT)
#   AWS_ACCESS_KEY_ID=...  AWS_SECRET_ACCESS_KEY=...
#   AWS_REGION=default  AWS_DEFAULT_REGION=default  (zonegroup name)
#   DCR_S3_CEPH_CONF=DIR/ceph.conf          for radosgw-admin/ceph -c
#
# Everything lives under DIR (config, mon store, memstore OSD, logs, admin
# sockets, pid list); nothing is written to /etc/ceph or /var/lib/ceph, and
# every ceph tool is called with an explicit -c DIR/ceph.conf.  Ports are
# random free loopback ports, so several clusters can run side by side.
# `stop` is idempotent and safe after a failed `start`; a failed `start`
# already kills what it launched but keeps DIR so its logs can be read.
#
# Environment overrides (all optional):
#   DCR_S3_PORT            radosgw HTTP port          (default: random free)
#   DCR_S3_MON_PORT        monitor (msgr v1) port     (default: random free)
#   DCR_S3_ACCESS_KEY      S3 access key              (default: fixed test key)
#   DCR_S3_SECRET_KEY      S3 secret key              (default: fixed test key)
#   DCR_S3_MEMSTORE_BYTES  OSD RAM store size         (default: 2 GiB)
#   DCR_S3_START_TIMEOUT   seconds for the whole start (default: 90)
#   DCR_S3_ALSO_LISTEN     one more local IPv4 address radosgw listens on,
#                          same port (bench/scale: the namespaces' bridge)
#
# Debian packages used (installed by `start` if missing, via apt-get, with
# sudo when not root): ceph-mon ceph-osd radosgw (they pull in ceph-base and
# ceph-common, which provide monmaptool, ceph, radosgw-admin), plus curl.
set -euo pipefail

readonly PACKAGES=(ceph-mon ceph-osd radosgw curl)
readonly MARKER=.dcr-radosgw        # marks a DIR made by this script
readonly REGION=default             # zonegroup name == SigV4 region

die() { echo "radosgw.sh: error: $*" >&2; exit 1; }
log() { echo "radosgw.sh: $*" >&2; }

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2
    exit 2
}

# --- packages ---------------------------------------------------------------

ensure_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' \
            || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    log "installing ${missing[*]} with apt-get"
    local sudo=()
    [[ $(id -u) -eq 0 ]] || sudo=(sudo)
    # The ceph postinst scripts try to enable systemd units; harmless here.
    if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends "${missing[@]}" \
            >/dev/null; then
        log "apt-get install failed; retrying after apt-get update"
        "${sudo[@]}" apt-get update -q >/dev/null
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends "${missing[@]}" \
            >/dev/null || die "apt-get install ${missing[*]} failed"
    fi
}

# --- helpers ----------------------------------------------------------------

# port_free PORT: true if nothing listens on 127.0.0.1:PORT (TCP).
port_free() {
    python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ceph does
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
EOF
}

# pick_port: a random free port below the kernel's ephemeral range, so that
# outgoing connections cannot grab it between picking and binding.
pick_port() {
    local p i
    for i in $(seq 1 100); do
        p=$((10000 + RANDOM % 20000))
        if port_free "$p"; then echo "$p"; return 0; fi
    done
    die "no free port found after $i tries"
}

remaining() { echo $((DEADLINE - SECONDS)); }

# step_timeout MAX: seconds a single step may take: what is left of the
# start deadline, at least 3 and at most MAX.
step_timeout() {
    local t
    t=$(remaining)
    (( t < 3 )) && t=3
    (( t > $1 )) && t=$1
    echo "$t"
}

# ceph_cmd ARGS...: the ceph CLI against this cluster, bounded in time.
ceph_cmd() {
    timeout "$(step_timeout 15)" ceph -c "$CONF" --connect-timeout 5 "$@"
}

# ceph_retry ARGS...: ceph_cmd for an idempotent command, tried again until
# it succeeds or 60 s have passed (on a loaded machine one CLI call can time
# out before it reaches the monitor); each try's errors go to
# $DIR/log/ceph-cli.log, which a failure shows.
ceph_retry() {
    local deadline=$((SECONDS + 60)) out
    while :; do
        if out=$(ceph_cmd "$@" 2>>"$DIR/log/ceph-cli.log"); then
            printf '%s' "$out"
            return 0
        fi
        (( SECONDS >= deadline )) && return 1
        echo "radosgw.sh: retrying ceph $*" >>"$DIR/log/ceph-cli.log"
        sleep 1
    done
}

# fail MSG [FILE...]: print MSG and the tail of each non-empty FILE (daemon
# log, captured stdout/stderr), kill what we launched, exit 1.
fail() {
    local msg=$1 f shown=0; shift
    echo "radosgw.sh: error: $msg" >&2
    for f in "$@"; do
        [[ -s $f ]] || continue
        echo "---- last lines of $f ----" >&2
        tail -n 25 "$f" >&2
        echo "---- end of $f ----" >&2
        shown=1
    done
    if (( ! shown && $# > 0 )); then
        echo "radosgw.sh: (no log output yet in $*)" >&2
    fi
    kill_daemons || true
    echo "radosgw.sh: daemons stopped; logs kept in $DIR/log" \
         "(run '$0 stop $DIR' to remove)" >&2
    exit 1
}

# launch NAME LOG CMD...: start a daemon in the foreground of its own session,
# record "NAME PID" in DIR/pids, and set LAUNCHED_PID.  A background job of
# this non-interactive shell is no process-group leader, so setsid execs the
# daemon in place and $! is the daemon's own pid.
launch() {
    local name=$1 out=$2; shift 2
    setsid "$@" </dev/null >>"$out" 2>&1 &
    LAUNCHED_PID=$!
    echo "$name $LAUNCHED_PID" >>"$DIR/pids"
}

# alive PID: true if PID still runs one of our commands (checked through its
# command line naming our config file, so a recycled pid is never matched).
alive() {
    local pid=$1 cmdline
    [[ -r /proc/$pid/cmdline ]] || return 1
    cmdline=$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") || return 1
    [[ $cmdline == *"$DIR/ceph.conf"* ]]
}

# wait_for DESC PID LOG CMD...: poll CMD until it succeeds; fail when the
# daemon PID dies or the start deadline passes.
wait_for() {
    local desc=$1 pid=$2 logf=$3; shift 3
    while true; do
        if "$@" >/dev/null 2>&1; then return 0; fi
        alive "$pid" || fail "$desc: daemon (pid $pid) exited" \
            "$logf" "${logf%.log}.out"
        (( $(remaining) > 0 )) || fail "$desc: timed out" \
            "$logf" "${logf%.log}.out"
        sleep 0.5
    done
}

# stop_pid PID: SIGTERM PID if it is still ours, wait up to 10 s for it to
# exit, then SIGKILL it and wait again.  False if it would not go away.
stop_pid() {
    local pid=$1 i
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 100); do
        alive "$pid" || return 0
        sleep 0.1
    done
    log "pid $pid ignored SIGTERM for 10 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do
        alive "$pid" || return 0
        sleep 0.1
    done
    log "pid $pid would not die"
    return 1
}

# kill_daemons: stop every recorded daemon, newest first (radosgw, OSD,
# monitor): one at a time, because a client shutting down while the monitor
# is already gone hangs for seconds.
kill_daemons() {
    [[ -f $DIR/pids ]] || return 0
    local pids=() name pid rc=0
    while read -r name pid; do
        [[ -n ${pid:-} ]] && pids=("$pid" "${pids[@]}")
    done <"$DIR/pids"
    : "$name"
    for pid in "${pids[@]}"; do
        stop_pid "$pid" || rc=1
    done
    return "$rc"
}

# --- config -----------------------------------------------------------------

write_conf() {
    # \$name etc. are Ceph metavariables, expanded by Ceph per daemon.
    cat >"$CONF" <<EOF
# Generated by tests/s3/radosgw.sh: throw-away single-node test cluster.
[global]
fsid = $FSID
# v1 address spelled out: a bare IP:PORT with a port other than 6789 is
# taken as msgr2, and radosgw then waits 5 minutes for its config and quits.
mon host = [v1:127.0.0.1:$MON_PORT]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv6 = false
ms bind msgr2 = false
auth cluster required = none
auth service required = none
auth client required = none
keyring = $DIR/keyring
run dir = $DIR/run
crash dir = $DIR/crash
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
# One OSD, no replication, few PGs.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
# Commit map changes at once instead of batching them for 1 s: radosgw's
# start creates pools one map epoch at a time, this cuts it from ~9 s.
paxos propose interval = 0.05
paxos min wait = 0.01
# Do not let a nearly full host disk stop the monitor.
mon data avail warn = 1
mon data avail crit = 0

[mon]
mon data = $DIR/mon/\$name
admin socket = $DIR/run/\$name.asok

[osd]
osd data = $DIR/osd/\$name
osd journal = $DIR/osd/\$name/journal
# With auth none the OSD can send its init-time mon commands (crush
# location, device class) before it has the monmap; they then carry a zero
# fsid, the monitor answers 'wrong fsid' and the OSD exits.  Skip them; the
# script places osd.0 in the crush map itself.
osd crush update on start = false
osd class update on start = false
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES
admin socket = $DIR/run/\$name.asok

[client.rgw]
admin socket = $DIR/run/\$name.asok
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT${DCR_S3_ALSO_LISTEN:+ endpoint=$DCR_S3_ALSO_LISTEN:$RGW_PORT} tcp_nodelay=1
rgw data = $DIR/rgw
rgw dns name = localhost
rgw thread pool size = 64
EOF
}

# --- start / stop -------------------------------------------------------------

cmd_start() {
    if [[ -e $DIR ]]; then
        if [[ -e $DIR/$MARKER ]]; then
            log "$DIR holds an old cluster; stopping it first"
            cmd_stop
        elif [[ -n $(ls -A "$DIR") ]]; then
            die "$DIR exists and is not empty"
        fi
    fi
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    CONF=$DIR/ceph.conf
    : >"$DIR/$MARKER"
    : >"$DIR/pids"

    # Ctrl-C or a CI kill during start: take our daemons down with us.
    trap 'fail "start interrupted"' INT TERM HUP

    local t0=$SECONDS
    ensure_packages
    local t_pkgs=$((SECONDS - t0))
    DEADLINE=$((SECONDS + ${DCR_S3_START_TIMEOUT:-90}))

    mkdir -p "$DIR"/{mon,osd,rgw,run,log,crash}
    FSID=$(cat /proc/sys/kernel/random/uuid)
    MON_PORT=${DCR_S3_MON_PORT:-$(pick_port)}
    RGW_PORT=${DCR_S3_PORT:-$(pick_port)}
    [[ $MON_PORT != "$RGW_PORT" ]] || RGW_PORT=$(pick_port)
    port_free "$MON_PORT" || die "monitor port $MON_PORT is in use"
    port_free "$RGW_PORT" || die "radosgw port $RGW_PORT is in use"
    MEMSTORE_BYTES=${DCR_S3_MEMSTORE_BYTES:-2147483648}
    local access=${DCR_S3_ACCESS_KEY:-DCRTESTACCESSKEY0001}
    local secret=${DCR_S3_SECRET_KEY:-dcrTestSecretKey0000000000000000000000001}
    write_conf

    # Monitor.
    local mlog=$DIR/log/mon.a.log
    timeout "$(step_timeout 30)" monmaptool --create --clobber \
        --fsid "$FSID" --addv a "[v1:127.0.0.1:$MON_PORT]" "$DIR/monmap" \
        >/dev/null 2>&1 \
        || fail "monmaptool failed"
    timeout "$(step_timeout 30)" ceph-mon -c "$CONF" --mkfs -i a \
        --monmap "$DIR/monmap" >>"$DIR/log/mon.a.out" 2>&1 \
        || fail "ceph-mon --mkfs failed" "$DIR/log/mon.a.out"
    launch mon.a "$DIR/log/mon.a.out" ceph-mon -c "$CONF" -i a -f
    local mon_pid=$LAUNCHED_PID
    wait_for "monitor" "$mon_pid" "$mlog" ceph_cmd mon stat
    log "monitor up on port $MON_PORT after $((SECONDS - t0)) s"

    # OSD on memstore (RAM only).
    local olog=$DIR/log/osd.0.log osd_uuid osd_id
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    # Both idempotent: the same uuid gets the same id, the same placement
    # changes nothing.
    osd_id=$(ceph_retry osd new "$osd_uuid") \
        || fail "ceph osd new failed" "$DIR/log/ceph-cli.log" "$mlog"
    [[ $osd_id == 0 ]] || fail "unexpected osd id '$osd_id'"
    ceph_retry osd crush add osd.0 1.0 root=default host=dcr-test >/dev/null \
        || fail "ceph osd crush add failed" "$DIR/log/ceph-cli.log" "$mlog"
    mkdir -p "$DIR/osd/osd.0"
    timeout "$(step_timeout 30)" ceph-osd -c "$CONF" -i 0 --mkfs \
        --osd-uuid "$osd_uuid" >>"$DIR/log/osd.0.out" 2>&1 \
        || fail "ceph-osd --mkfs failed" "$DIR/log/osd.0.out"
    launch osd.0 "$DIR/log/osd.0.out" ceph-osd -c "$CONF" -i 0 -f
    local osd_pid=$LAUNCHED_PID
    osd_up() { ceph_cmd osd stat -f json | grep -q '"num_up_osds":1'; }
    wait_for "osd.0 up" "$osd_pid" "$olog" osd_up
    log "osd.0 up after $((SECONDS - t0)) s"

    # radosgw; it creates its pools and the default zone/zonegroup itself.
    local rlog=$DIR/log/client.rgw.log
    launch client.rgw "$DIR/log/client.rgw.out" \
        radosgw -c "$CONF" -n client.rgw -f
    local rgw_pid=$LAUNCHED_PID
    rgw_http() {
        local code
        code=$(curl -s -o /dev/null -m 2 -w '%{http_code}' \
            "http://127.0.0.1:$RGW_PORT/") || return 1
        [[ $code == 200 ]]
    }
    wait_for "radosgw HTTP on port $RGW_PORT" "$rgw_pid" "$rlog" rgw_http

    # S3 user with known keys.
    timeout "$(step_timeout 30)" radosgw-admin -c "$CONF" user create \
        --uid dcr-test --display-name "dcr test" --access-key "$access" \
        --secret-key "$secret" >>"$DIR/log/radosgw-admin.out" 2>&1 \
        || fail "radosgw-admin user create failed" \
            "$DIR/log/radosgw-admin.out"

    # One signed request (ListBuckets) proves the keys and the region work.
    # curl signs with the body hash but does not send x-amz-content-sha256,
    # which radosgw then takes as UNSIGNED-PAYLOAD: so send that explicitly.
    local body
    body=$(curl -s -m 10 --aws-sigv4 "aws:amz:$REGION:s3" \
        -u "$access:$secret" -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' \
        "http://127.0.0.1:$RGW_PORT/") || body="(curl failed)"
    [[ $body == *"<ID>dcr-test</ID>"* ]] \
        || fail "signed S3 request as the new user failed: $body" "$rlog"

    cat >"$DIR/env" <<EOF
DCR_S3_ENDPOINT=http://127.0.0.1:$RGW_PORT
AWS_ACCESS_KEY_ID=$access
AWS_SECRET_ACCESS_KEY=$secret
AWS_REGION=$REGION
AWS_DEFAULT_REGION=$REGION
DCR_S3_CEPH_CONF=$CONF
EOF
    trap - INT TERM HUP
    log "up in $((SECONDS - t0)) s (packages ${t_pkgs} s):" \
        "S3 at http://127.0.0.1:$RGW_PORT, env in $DIR/env"
}

cmd_stop() {
    [[ -e $DIR ]] || return 0
    DIR=$(cd "$DIR" && pwd)
    # An empty DIR (say from mktemp -d, start never ran): just remove it.
    if [[ -z $(ls -A "$DIR") ]]; then rmdir "$DIR"; return 0; fi
    [[ -e $DIR/$MARKER ]] \
        || die "$DIR was not made by radosgw.sh; not touching it"
    kill_daemons || die "could not stop every daemon of $DIR"
    rm -rf "$DIR"
}

cmd_env() {
    [[ -f $DIR/env ]] || die "$DIR/env missing: cluster not started?"
    sed 's/^/export /' "$DIR/env"
}

cmd_status() {
    [[ -f $DIR/pids ]] || return 1
    local name pid n=0
    while read -r name pid; do
        alive "$pid" || { log "$name (pid $pid) is not running"; return 1; }
        n=$((n + 1))
    done <"$DIR/pids"
    (( n == 3 ))
}

[[ $# -eq 2 ]] || usage
DIR=${2%/}
[[ -n $DIR ]] || usage
[[ $DIR != *[[:space:]]* ]] || die "DIR must not contain white space"
CONF=$DIR/ceph.conf
case $1 in
    start) cmd_start ;;
    stop) cmd_stop ;;
    env) cmd_env ;;
    status) DIR=$(cd "$DIR" 2>/dev/null && pwd) || exit 1; cmd_status ;;
    *) usage ;;
esac
