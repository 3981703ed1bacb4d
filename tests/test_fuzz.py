"""Coverage-guided fuzzing (libFuzzer, with AddressSanitizer and UndefinedBehaviorSanitizer)
of the parsers that read a peer's bytes: the control frames, both sides of the handshake, the
data connection's chunk header and ack, and the RDMA setup frames. Each target under
tests/fuzz calls the parser in csrc on the input sent over a real socket and checks what it
returned against the input (each file's header says what it checks). Each runs a fixed
number of inputs, starting from its seed corpus in the tree (tests/fuzz/corpus/<target>,
written by tests/fuzz/make_corpus.py); a crash, a sanitizer report or a failed check fails
it, and libFuzzer's output names the input it saved.

    python -m pytest tests/test_fuzz.py          # PDDCORE_FUZZ_RUNS=2000000 runs longer

Needs clang with libFuzzer (Debian: clang-14 libclang-rt-14-dev); skips without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "tests" / "fuzz"
sys.path.insert(0, str(FUZZ))
import make_corpus  # noqa: E402

pytestmark = pytest.mark.slow

# Each target's parser sources in csrc; every target also links the socket I/O.
TARGETS = {
    "control_frame": ["transport/control_frames.cpp"],
    "accept_handshake": ["transport/handshake.cpp"],
    "dial_handshake": ["transport/handshake.cpp"],
    "data_headers": [],
    "rdma_setup": [],
}
SOCKET_IO = ["transport/socket.cpp", "transport/tls.cpp"]
RUNS = int(os.environ.get("PDDCORE_FUZZ_RUNS", "100000"))
COMPILE = ["-std=c++17", "-O1", "-g", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all"]
# -malloc_limit_mb: no input (at most max_len bytes) may make a parser allocate a megabyte at
# once, so a buffer sized by what a peer announces rather than by what arrived is a failure.
# A fixed seed, so runs try much the same inputs; the input libFuzzer saves reproduces a failure.
RUN = ["-seed=1", "-max_len=16384", "-malloc_limit_mb=1", "-timeout=20"]


def clang() -> str:
    for name in ("clang++", "clang++-14"):
        if shutil.which(name):
            return name
    pytest.skip("no clang++ for the fuzz targets (Debian: apt-get install clang-14 libclang-rt-14-dev)")


def compile_object(compiler: str, csrc: Path, source: str, out_dir: Path) -> Path:
    out = out_dir / (source.replace("/", "_") + ".o")
    subprocess.run([compiler, *COMPILE, f"-I{csrc / 'include'}", f"-I{csrc}", "-c", str(csrc / source), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def link_target(compiler: str, csrc: Path, target: str, objects: list[Path], out_dir: Path) -> Path:
    out = out_dir / target
    run = subprocess.run([compiler, *COMPILE, f"-I{csrc / 'include'}", f"-I{csrc}", f"-I{FUZZ}", str(FUZZ / f"{target}.cpp"),
                          *map(str, objects), "-o", str(out), "-pthread", "-lssl", "-lcrypto"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def build(compiler: str, csrc: Path, targets: list[str], out_dir: Path,
          objects: dict[str, Path] | None = None) -> tuple[dict[str, Path], dict[str, Path]]:
    """Builds the fuzz targets against the sources under ``csrc``, in parallel on every core,
    reusing the already built ``objects`` {source: object file}; returns the targets'
    binaries and every object they link."""
    objects = dict(objects or {})
    sources = sorted({s for t in targets for s in TARGETS[t]} | set(SOCKET_IO) - set(objects))
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        objects.update(zip(sources, pool.map(lambda s: compile_object(compiler, csrc, s, out_dir), sources)))
        binaries = pool.map(lambda t: link_target(compiler, csrc, t, [objects[s] for s in TARGETS[t] + SOCKET_IO], out_dir),
                            targets)
        return dict(zip(targets, binaries)), objects


def probe_libfuzzer(compiler: str, tmp: Path) -> None:
    probe = tmp / "probe.cpp"
    probe.write_text('#include <cstddef>\n#include <cstdint>\n'
                     'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n')
    run = subprocess.run([compiler, "-fsanitize=fuzzer,address,undefined", str(probe), "-o", str(tmp / "probe")],
                         capture_output=True, text=True)
    if run.returncode != 0:
        pytest.skip(f"{compiler} cannot link libFuzzer (Debian: apt-get install libclang-rt-14-dev): {run.stderr[-300:]}")


def fuzz(binary: Path, corpus: Path, work: Path, runs: int) -> subprocess.CompletedProcess:
    """Runs ``runs`` inputs; new inputs go to ``work``, the seeds in ``corpus`` stay as they are."""
    work.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(binary), str(work), str(corpus), f"-runs={runs}", f"-artifact_prefix={work}/", *RUN],
                          capture_output=True, text=True, cwd=work)


@dataclass
class Built:
    compiler: str
    binaries: dict[str, Path]
    objects: dict[str, Path]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    compiler = clang()
    out = tmp_path_factory.mktemp("fuzz")
    probe_libfuzzer(compiler, out)
    return Built(compiler, *build(compiler, ROOT / "csrc", list(TARGETS), out))


def test_corpus_in_the_tree_is_what_make_corpus_writes(tmp_path):
    make_corpus.write(tmp_path)
    written = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    in_tree = {p.relative_to(FUZZ / "corpus"): p.read_bytes() for p in (FUZZ / "corpus").rglob("*") if p.is_file()}
    assert written == in_tree
    assert {p.parts[0] for p in written} == set(TARGETS)


@pytest.mark.parametrize("target", list(TARGETS))
def test_fuzz_target(target, built, tmp_path):
    run = fuzz(built.binaries[target], FUZZ / "corpus" / target, tmp_path / "work", RUNS)
    assert run.returncode == 0, run.stderr[-6000:]
    assert re.search(rf"^Done {RUNS} runs", run.stderr, re.M), run.stderr[-2000:]


# Bugs planted in a copy of csrc, each one line of a parser changed, that the fuzzer must
# find within the same number of runs: (target, file under csrc, the line's text, planted
# text, the target's sources that include the file, a pattern of what the run reports).
PLANTED = {
    # The control frame's payload buffer sized by the length the peer announced, before any
    # byte arrived (what issue 25 found: 40 connections x 17 bytes held 641 MiB).
    "payload_sized_by_announced_length": ("control_frame", "transport/framing.h", "std::max(got, kFirstPiece)",
                                          "header->length", ["transport/control_frames.cpp"],
                                          r"libFuzzer: out-of-memory \(malloc\(\d+\)\)"),
    # A QP list trusted to hold as many QPs as its count says: reads past the payload (ASan),
    # or decodes a list whose size does not match its count (the target's check).
    "qp_count_trusted": ("rdma_setup", "transport/rdma/rdma_wire.h",
                         "payload.size() != 4 + n * QpAttributes::kSize", "payload.size() < 4", [],
                         r"AddressSanitizer: heap-buffer-overflow|fuzz check failed: qps.empty\(\) == !valid"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_fuzzer_finds_a_planted_bug(bug, built, tmp_path):
    target, path, line, planted, includers, report = PLANTED[bug]
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc, ignore=shutil.ignore_patterns("*.cu", "emulator"))
    text = (csrc / path).read_text()
    assert text.count(line) == 1, f"{path} no longer holds {line!r}: plant the bug anew"
    (csrc / path).write_text(text.replace(line, planted))
    unchanged = {s: o for s, o in built.objects.items() if s not in includers}
    binaries, _ = build(built.compiler, csrc, [target], tmp_path, unchanged)
    run = fuzz(binaries[target], FUZZ / "corpus" / target, tmp_path / "work", RUNS)
    assert run.returncode != 0 and re.search(report, run.stderr), run.stderr[-3000:]
    assert list((tmp_path / "work").glob("crash-*")) or list((tmp_path / "work").glob("oom-*")), "no input saved"
