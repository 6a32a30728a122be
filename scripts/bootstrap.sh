#!/usr/bin/env bash
# Install what the embedded stack needs on Debian 12, as root; reuse what runs.
# Idempotent: every step checks before it acts.
set -euo pipefail

need_pkgs=()
want() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$1"); }

# docker-compose only checks the deployment file (`docker-compose config`); it runs nothing.
# kcat, openssl and jq: a trainer written in bash (docs/protocol.md, tests/integration/test_kcat.py).
# docker-registry: Distribution 2.8, the image hub `dsec up` runs (app/stack/hub.py).
# iptables: the fence between sandboxes with network and the node (workers/host/setup.py);
# a node without it refuses creates that ask for network. nftables: egress allowlists
# (workers/host/egress.py); a node without nft refuses creates that ask for one.
for p in podman runc uidmap slirp4netns fuse-overlayfs busybox-static gcc libc6-dev debootstrap \
    docker-compose kcat openssl jq docker-registry iptables nftables; do want "$p"; done
# chromium: a browser loads a page and its WebSocket from a sandbox's exposed port
# (tests/integration/test_ports.py).
want chromium
# Apache Kafka runs on a JRE; Maven fetches it from Maven Central (app/stack/kafka_dist.py).
command -v java >/dev/null || want openjdk-17-jre-headless
command -v mvn >/dev/null || want maven

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! port_open 5432 && ! command -v pg_ctlcluster >/dev/null; then want postgresql; fi
# The stack runs its own Redis (password, append-only file): the binary is enough.
command -v redis-server >/dev/null || want redis-server

if ((${#need_pkgs[@]})); then
    echo "bootstrap: installing ${need_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if ! port_open 5432; then
    echo "bootstrap: starting PostgreSQL"
    cluster=$(ls /etc/postgresql | head -1)
    pg_ctlcluster --skip-systemctl-redirect "$cluster" main start
    for _ in $(seq 50); do port_open 5432 && break; sleep 0.2; done
fi
# No trust rules are added: `dsec up` makes the dsec roles with passwords, as the
# postgres system user over the local socket (peer), and asks pg_hba for them.
echo "bootstrap: system ready"
