#!/usr/bin/env bash
# A trainer with nothing but bash, kcat, openssl and jq, from docs/protocol.md alone:
# create a sandbox, run a command, print its output, destroy the sandbox.
#
#   kcat_trainer.sh CREDENTIAL_FILE BOOTSTRAP [PREFIX]
#
# Prints the command's stdout; exits non-zero with a reason on any failure.
set -euo pipefail

credential=$1 bootstrap=$2 prefix=${3:-dsec}
key_id=$(jq -r .key_id "$credential")
secret=$(jq -r .secret "$credential")
tenant=$(jq -r .subject "$credential")
replies="$prefix.replies.$tenant"

work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
chmod 700 "$work"

# The principal's password goes in a file only we read, never on a command line.
# murmur2_random: a record keyed by a sandbox id lands on the partition the platform
# (and kafka-python) computes for that key; librdkafka's default would pick another.
cat > "$work/kafka.conf" <<EOF
bootstrap.servers=$bootstrap
security.protocol=SASL_PLAINTEXT
sasl.mechanisms=SCRAM-SHA-512
sasl.username=$(jq -r .kafka.username "$credential")
sasl.password=$(jq -r .kafka.password "$credential")
partitioner=murmur2_random
socket.nagle.disable=true
queue.buffering.max.ms=0
EOF

hmac_hex() { # KEY_HEX: HMAC-SHA256 of stdin, lowercase hex
    openssl dgst -sha256 -mac HMAC -macopt "hexkey:$1" -r | cut -d' ' -f1
}

# Replies: one partition of our topic (their count from the broker's metadata), read
# from its end as it stood *before* anything is sent.
partitions=$(kcat -F "$work/kafka.conf" -L -t "$replies" -J | jq '.topics[0].partitions | length')
[ "$partitions" -gt 0 ] || { echo "no replies topic $replies" >&2; exit 1; }
partition=$((RANDOM % partitions))
start=$(kcat -F "$work/kafka.conf" -Q -t "$replies:$partition:-1" | awk '{print $NF}')
kcat -F "$work/kafka.conf" -C -u -q -t "$replies" -p "$partition" -o "$start" \
    -f '%h\t%s\n' > "$work/replies" &

send() { # TYPE EXTRA_JSON: sign and send a request; prints its request id
    local request_id body mac
    request_id=$(cat /proc/sys/kernel/random/uuid)
    body=$(jq -cn --arg t "$1" --arg r "$request_id" --arg s "$sandbox" \
        --arg at "$(date -u +%Y-%m-%dT%H:%M:%S.%3NZ)" --arg topic "$replies" \
        --argjson p "$partition" --argjson extra "$2" \
        '{type: $t, request_id: $r, version: 1, sandbox_id: $s, job_id: "kcat",
          sent_at: $at, reply_to: {topic: $topic, partition: $p}} + $extra')
    mac=$(printf 'dsec-request-v1\n%s' "$body" | hmac_hex "$secret")
    printf '%s\n' "$body" | kcat -F "$work/kafka.conf" -P -t "$prefix.requests" \
        -k "$sandbox" -H "dsec-key=$key_id" -H "dsec-mac=$mac"
    echo "$request_id"
}

answer() { # REQUEST_ID: waits for its proven reply (not an output chunk); prints it
    local reply_key deadline=$((SECONDS + 120))
    reply_key=$(printf 'dsec-reply-v1\0%s' "$1" | hmac_hex "$secret")
    while [ $SECONDS -lt $deadline ]; do
        while IFS=$'\t' read -r headers value; do
            [ "$(jq -r .request_id <<<"$value" 2>/dev/null)" = "$1" ] || continue
            [ "$(jq -r .kind <<<"$value")" != output ] || continue
            mac=$(printf 'dsec-reply-v1\n%s' "$value" | hmac_hex "$reply_key")
            # A reply whose proof does not hold is anyone's forgery: dropped.
            [[ "$headers" == *"dsec-mac=$mac"* ]] || continue
            echo "$value"
            return 0
        done < "$work/replies"
        sleep 0.2
    done
    echo "no reply to $1" >&2
    return 1
}

expect_kind() { # KIND REPLY
    [ "$(jq -r .kind <<<"$2")" = "$1" ] || { echo "expected $1, got: $2" >&2; exit 1; }
}

sandbox="kcat-$(cat /proc/sys/kernel/random/uuid | cut -c1-8)"
expect_kind ready "$(answer "$(send CreateSandbox '{"memory_mb": 64, "ttl_s": 300}')")"
out=$(answer "$(send Exec '{"command": "echo hello from $(hostname)", "timeout_s": 30}')")
expect_kind exec "$out"
jq -r .stdout_b64 <<<"$out" | base64 -d
expect_kind done "$(answer "$(send DestroySandbox '{}')")"
