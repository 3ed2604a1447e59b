#!/usr/bin/env bash
# The router path against a running kvfuse-server, through kvfuse-cli:
#   Prefill (expected_len 0) -> Decode(16) and its retry (the same answer) -> a Decode of
#   256 steps under a short deadline (usually cut off) and its retry without one (all 256
#   tokens, the earlier attempt's included) -> Release -> every KV page free again.
# Usage: scripts/ci/router-check.sh KVFUSE_CLI ADDR [PROMPT_LEN]. Run it when no other
# client holds pages (after a load run). One line per step; exit 0 when every step gave
# what it should. scripts/gpu/serve.sh runs it on a GPU server; a CPU test runs it too.
set -uo pipefail
cli=$1 addr=$2 plen=${3:-64} id=${ROUTER_CHECK_ID:-7001}
call() { "$cli" --addr "$addr" "$@"; }
say() { echo "router-check: $*"; }
fail() {
  say "FAIL: $*"
  call release --id "$id" >/dev/null 2>&1
  exit 1
}
tokens_in() { grep -o '"tokenIds":\[[^]]*\]' <<<"$1" | grep -o '[0-9]\+' | wc -l; }

out=$(call prefill --id "$id" --prompt-ids "$(seq -s, 1 "$plen")" --expected-len 0) || fail "prefill: $out"
len=$((plen + 1))
say "prefill of $plen tokens: OK"
first=$(call decode --id "$id" -n 16 --expected-len "$len") || fail "decode: $first"
again=$(call decode --id "$id" -n 16 --expected-len "$len") || fail "decode retry: $again"
[[ $first == "$again" ]] || fail "the retried decode answered otherwise: $first / $again"
(($(tokens_in "$first") == 16)) || fail "decode of 16 steps gave $(tokens_in "$first") tokens: $first"
len=$((len + 16))
say "decode of 16 steps, and its retry: the same answer"
call --timeout-s 0.02 decode --id "$id" -n 256 --expected-len "$len" >/dev/null 2>&1
rc=$?
((rc == 0 || rc == 4)) || fail "decode under a 20 ms deadline exited $rc (neither OK nor DEADLINE_EXCEEDED)"
say "decode of 256 steps under a 20 ms deadline: $( ((rc == 4)) && echo "cut off (DEADLINE_EXCEEDED)" || echo "done in time")"
# The cancelled task ends at a step boundary; until then the sequence is busy (ABORTED, 10).
for _ in $(seq 100); do
  out=$(call decode --id "$id" -n 256 --expected-len "$len" 2>&1)
  rc=$?
  ((rc == 10)) || break
  sleep 0.05
done
((rc == 0)) || fail "the retry of the 256-step decode exited $rc: $out"
(($(tokens_in "$out") == 256)) || fail "the retry of the 256-step decode gave $(tokens_in "$out") tokens"
say "its retry: 256 tokens"
out=$(call release --id "$id") || fail "release: $out"
grep -q "\"released\":\[\"$id\"\]" <<<"$out" || fail "release did not free $id: $out"
for _ in $(seq 200); do
  load=$(call load) || fail "load: $load"
  used=$(grep -o '"usedPages":"[0-9]*"' <<<"$load" | grep -vc '"usedPages":"0"')
  ((used == 0)) && break
  sleep 0.05
done
((used == 0)) || fail "pages still used after release: $load"
say "release: every page free. PASS"
