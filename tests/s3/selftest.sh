#!/usr/bin/env bash
# selftest.sh - check that tests/s3/radosgw.sh brings up a working S3
# endpoint: start a cluster, run signed S3 requests with curl (no Python or
# SDK needed), stop it, and verify that no daemon is left behind.
#
# Usage: tests/s3/selftest.sh        (exit 0 iff every check passed)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d /tmp/dcr-rgw-selftest.XXXXXX)
trap '"$here/radosgw.sh" stop "$dir"' EXIT

"$here/radosgw.sh" start "$dir"
set -a
# shellcheck source=/dev/null
. "$dir/env"
set +a

passed=0 failed=0
check() {       # check NAME EXPECTED ACTUAL
    if [[ $2 == "$3" ]]; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL: $1: expected '$2', got '$3'" >&2
    fi
}

# s3 METHOD PATH [CURL-ARGS...]: signed request, prints "STATUS BODY".
s3() {
    local method=$1 path=$2; shift 2
    curl -s -m 20 -X "$method" --aws-sigv4 "aws:amz:$AWS_REGION:s3" \
        -u "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" \
        -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' \
        -w ' %{http_code}' "$@" "$DCR_S3_ENDPOINT$path"
}
status() { "$@" | awk '{print $NF}'; }

b=/selftest-bucket
check "create bucket" 200 "$(status s3 PUT "$b")"
check "put object" 200 "$(status s3 PUT "$b/dir/key" --data-binary hello)"
check "get object" "hello 200" "$(s3 GET "$b/dir/key")"
check "ranged get" "ell 206" "$(s3 GET "$b/dir/key" -H 'Range: bytes=1-3')"
check "put if-none-match on existing key" 412 \
    "$(status s3 PUT "$b/dir/key" --data-binary x -H 'If-None-Match: *')"
check "put if-none-match on new key" 200 \
    "$(status s3 PUT "$b/dir/new" --data-binary x -H 'If-None-Match: *')"
check "object kept" "hello 200" "$(s3 GET "$b/dir/key")"
# curl 7.88's signer wants query parameters sorted and already %-encoded.
list=$(s3 GET "$b?list-type=2&prefix=dir%2F")
check "list v2 keys" "dir/key dir/new" \
    "$(grep -o '<Key>[^<]*</Key>' <<<"$list" | sed 's/<[^>]*>//g' | xargs)"
check "missing key" 404 "$(status s3 GET "$b/nope")"
check "missing bucket" 404 "$(status s3 GET /no-such-bucket/x)"
check "delete object" 204 "$(status s3 DELETE "$b/dir/key")"
check "delete object" 204 "$(status s3 DELETE "$b/dir/new")"
check "delete bucket" 204 "$(status s3 DELETE "$b")"

pids=$(awk '{print $2}' "$dir/pids")
"$here/radosgw.sh" stop "$dir"
trap - EXIT
left=0
for pid in $pids; do
    [[ -n $(tr -d '\0' 2>/dev/null </proc/"$pid"/cmdline) ]] && left=$((left + 1))
done
check "daemons gone after stop" 0 "$left"
check "DIR removed after stop" no "$([[ -e $dir ]] && echo yes || echo no)"

echo "selftest: $passed passed, $failed failed"
(( failed == 0 ))
