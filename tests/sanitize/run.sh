#!/usr/bin/env bash
# One command: builds pddcore._C (and the verbs emulator it opens for rdma-emulated peers)
# with AddressSanitizer and UndefinedBehaviorSanitizer into build/sanitize, apart from the
# installed editable build, and runs against it the transfer, security and TLS tests, then
# every C++ unit case built with the same sanitizers (PDDCORE_SANITIZE=1, tests/cpp_unit.py).
# Every Python process the tests start loads the sanitized module (sitecustomize.py here)
# with libasan preloaded. A sanitizer report aborts its process and is also written under
# build/sanitize/reports (pytest captures the stderr of a test and of the peers it spawns);
# any report there fails the run.
#
#   bash tests/sanitize/run.sh [more pytest arguments for the Python tests]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=build/sanitize
reports="$PWD/$build/reports"
mkdir -p "$build"
rm -rf "$reports" && mkdir -p "$reports"
started=$SECONDS
# -O1 and line tables only: half the build time of -O3 with full debug information, and
# reports still name file and line.
sanitizers="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1"
echo "building the sanitized pddcore._C in $build (log: $build/build.log)"
cmake -S . -B "$build" -DPDD_WITH_CUDA=OFF -DPDD_OPTIMIZE=-O1 -DCMAKE_CXX_FLAGS="$sanitizers" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" -DPython_EXECUTABLE="$(command -v python)" \
  -Dnanobind_DIR="$(python -m nanobind --cmake_dir)" > "$build/build.log" 2>&1
targets=(_C)
if grep -q '^PDD_IBVERBS_INCLUDE_DIR:PATH=/' "$build/CMakeCache.txt"; then targets+=(_verbs_emulator); fi
cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" >> "$build/build.log" 2>&1
echo "built in $((SECONDS - started)) s"

status=0
# A temporary directory of its own: the pytest suite may run beside this one (tests/run.sh).
basetemp="$PWD/$build/pytest-tmp"
tests_started=$SECONDS
(
  PDDCORE_SANITIZED_C="$(realpath "$build"/_C.*.so)"
  export PDDCORE_SANITIZED_C
  export PYTHONPATH="$PWD/tests/sanitize${PYTHONPATH:+:$PYTHONPATH}"
  # Python itself is not instrumented: libasan must come first (and libstdc++ with it, or
  # ASan cannot find the real __cxa_throw and aborts at the first C++ exception), and its
  # leak report would list the interpreter's own allocations.
  LD_PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libstdc++.so)"
  export LD_PRELOAD
  export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:print_summary=1:log_path=$reports/asan"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
  python -c 'import os, pddcore._C as c; assert c.__file__ == os.environ["PDDCORE_SANITIZED_C"], c.__file__'
  python -m pytest tests/test_transfer_tcp.py tests/test_transfer_security.py tests/test_transfer_tls.py \
    tests/test_transfer_certificates.py -q -p no:cacheprovider --basetemp="$basetemp" "$@"
) || status=$?
echo "transfer, security and TLS tests: $((SECONDS - tests_started)) s"
cases_started=$SECONDS
# Only the files that hold C++ cases: collecting every test imports the engines (a minute).
mapfile -t case_files < <(grep -l "case_test(" tests/test_*.py)
PDDCORE_SANITIZE=1 ASAN_OPTIONS="detect_leaks=1:log_path=$reports/asan" UBSAN_OPTIONS="log_path=$reports/ubsan" \
  python -m pytest "${case_files[@]}" -k cpp- -q -p no:cacheprovider --basetemp="$basetemp" || status=$?
echo "C++ unit cases: $((SECONDS - cases_started)) s"

if compgen -G "$reports/*" > /dev/null; then
  echo "sanitizer reports:" >&2
  cat "$reports"/* >&2
  status=1
fi
echo "sanitized run: $((SECONDS - started)) s in all, exit status $status"
exit "$status"
