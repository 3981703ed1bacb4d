#!/usr/bin/env bash
# Every test CI runs: the pytest suite and, beside it, the sanitized run
# (tests/sanitize/run.sh: the transfer, security and TLS tests and the C++ cases on a build of
# pddcore._C with ASan and UBSan). The suite, waiting on its servers and sockets much of the
# time, keeps about one core busy on average, so the sanitized run goes at a lower priority
# and takes what the suite leaves idle. Its output goes to build/sanitize/run.log and is printed once the suite
# is done; either one failing fails this command.
#
#   bash tests/run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/sanitize
log=build/sanitize/run.log
nice -n 10 bash tests/sanitize/run.sh > "$log" 2>&1 &
sanitized_pid=$!
python -m pytest tests -q
suite=$?
wait "$sanitized_pid"
sanitized=$?
echo "---- the sanitized run, beside the suite ($log) ----"
cat "$log"
echo "pytest suite: exit status $suite; sanitized run: exit status $sanitized"
[ "$suite" = 0 ] && [ "$sanitized" = 0 ]
