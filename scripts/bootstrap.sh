#!/usr/bin/env bash
# Install what the embedded stack needs on Debian 12, as root; reuse what runs.
# Idempotent: every step checks before it acts.
set -euo pipefail

need_pkgs=()
want() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$1"); }

for p in podman runc uidmap slirp4netns fuse-overlayfs busybox-static gcc libc6-dev debootstrap; do want "$p"; done

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! port_open 5432 && ! command -v pg_ctlcluster >/dev/null; then want postgresql; fi
if ! port_open 6379 && ! command -v redis-server >/dev/null; then want redis-server; fi

if ((${#need_pkgs[@]})); then
    echo "bootstrap: installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if ! port_open 5432; then
    echo "bootstrap: starting PostgreSQL"
    cluster=$(ls /etc/postgresql | head -1)
    pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
    # Local trust for the owner and the service role, as on the CI machines.
    for _ in $(seq 50); do port_open 5432 && break; sleep 0.2; done
fi
if ! psql -h 127.0.0.1 -U postgres -d postgres -Atc 'select 1' >/dev/null 2>&1; then
    hba=$(ls /etc/postgresql/*/main/pg_hba.conf | head -1)
    if ! grep -q '^# dsec' "$hba"; then
        echo "bootstrap: allowing local trust auth for dsec in $hba"
        sed -i '1i # dsec: local development trusts loopback\nhost all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main reload
    fi
fi

if ! port_open 6379; then
    echo "bootstrap: starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/dsec.log
    for _ in $(seq 50); do port_open 6379 && break; sleep 0.2; done
fi
echo "bootstrap: system ready"
