"""Checks on README.md and docs/*.md.

* The README stays a front door: under README_LIMIT_BYTES.
* Every relative link and image resolves to a file, and every #anchor to a heading.
* Every `pddcore ...` line of a bash block parses with the real command-line parser.
* Every Python block runs: a page's blocks, in order, as one script in a scratch
  directory (so a block may use what an earlier block of its page defined). A block that
  needs what a CPU-only machine lacks says so on its first line, and is left out for that
  reason alone where the machine lacks it:

      # needs: gpu               a CUDA device
      # needs: root              root, with what the WAN emulator needs (every such block
                                 here builds a WAN link: pddcore.testing.wan.unavailable_reason)
      # needs: gpu, rdma-nic     several needs, comma-separated; rdma-nic: an RDMA device

  Any other need is an error, so a block cannot opt out by a made-up reason.
* Every shell block (bash, sh) parses: ``bash -n``.
* Figures quoted beside a sample output are in that sample. A section whose heading
  starts with "Sample output" shows a fenced block; each number in the prose after the
  block must be a number of the block, to the precision the prose gives (prose 0.80x
  matches 0.797x) and, when the prose gives a unit, in that unit. A paragraph anywhere
  that links to such a section is held to the same rule.

Example of what fails: a sample block holding ``avx512 in cache 69.4 GB/s`` and the
prose after it saying ``85 GB/s in cache``.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT_BYTES = 12 * 1024

_FENCE = re.compile(r"^\s*```\s*(\w*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_LIST_ITEM = re.compile(r"\s*(?:[-*]|\d+\.)\s")
# Dates, clock times, dotted versions and addresses label a run; they are not figures.
_NOT_FIGURES = re.compile(r"\d{4}-\d\d-\d\d(?:T[\d:.]+(?:[+-]\d\d:\d\d)?)?|\b\d\d:\d\d\b|\b\d+\.\d+\.\d+\S*")
_NUMBER = r"\d+(?:\.\d+)?(?:e[+-]?\d+)?"
# Units a figure may carry, each alias mapped to one spelling. "x" (a ratio) follows its
# number directly; the others may follow a space.
_UNITS = {"GB/s": "GB/s", "Gbit/s": "Gbit/s", "Gb/s": "Gbit/s", "Mbit/s": "Mbit/s", "kpps": "kpps",
          "ops/s": "ops/s", "pkt/s": "pkt/s", "ms": "ms", "s": "s", "%": "%", "KB": "KB", "MB": "MB",
          "KiB": "KiB", "MiB": "MiB", "B": "B"}
_UNIT = r"(x|\s?(?:" + "|".join(sorted(map(re.escape, _UNITS), key=len, reverse=True)) + r"))(?![\w/])"
_FIGURE = re.compile(rf"({_NUMBER})(?:{_UNIT})?")
_RANGE_END = re.compile(rf"\s?[-–]\s?{_NUMBER}{_UNIT}")  # "1.1-1.4x": the unit of both ends
# A row of `pddcore bench`'s summary table: its baseline column has the value's unit.
_SUMMARY_ROW = re.compile(r"\s(?P<value>[\d.e+-]+) (?P<unit>\S+)\s+(?P<baseline>[\d.e+-]+)\s{2,}\S.*\s[\d.e+-]+x$")


@dataclass(frozen=True)
class Figure:
    text: str  # as written, e.g. "0.80"
    unit: str | None  # canonical unit; None when the text gives none

    def __str__(self) -> str:
        return f"{self.text}x" if self.unit == "x" else f"{self.text} {self.unit or ''}".strip()

    def rounds_from(self, measured: "Figure") -> bool:
        """True when `measured` (a sample's number) rounds to this figure, in the same unit."""
        if self.unit is not None and self.unit != measured.unit:
            return False
        decimals = len(self.text.split(".")[1]) if "." in self.text and "e" not in self.text else 0
        return abs(float(measured.text) - float(self.text)) <= 0.5 * 10 ** -decimals * (1 + 1e-9)


@dataclass(frozen=True)
class Section:
    page: Path
    heading: str
    anchor: str
    lines: list[tuple[str, str | None]]  # (line, language of the fenced block it is in, "" for none given)

    @property
    def is_sample(self) -> bool:
        return self.heading.startswith("Sample output")

    def sample_block_and_prose(self) -> tuple[str, str]:
        """The first fenced block, and the prose after it (later fenced blocks left out)."""
        fences = [i for i, (line, _) in enumerate(self.lines) if _FENCE.match(line)]
        if len(fences) < 2:
            return "", ""
        block = "\n".join(line for line, _ in self.lines[fences[0] + 1:fences[1]])
        prose = "\n".join(line for line, lang in self.lines[fences[1] + 1:] if lang is None)
        return block, prose


def _unit(text: str | None) -> str | None:
    return None if text is None else "x" if text == "x" else _UNITS[text.strip()]


def figures(text: str) -> list[Figure]:
    """Numbers of `text` that stand as figures: not part of a word (p99, sm_90, AES-128,
    64K), nor a date, clock time, version or address."""
    text = _NOT_FIGURES.sub(" ", text)
    found = []
    for m in _FIGURE.finditer(text):
        two_before, after = text[max(m.start() - 2, 0):m.start()].rjust(2), text[m.end():m.end() + 1]
        word_before = two_before[1] == "-" and (two_before[0].isalpha() or two_before[0] == "_")  # AES-128
        if two_before[1].isalnum() or two_before[1] in "_." or word_before:
            continue
        unit = m.group(2)
        if unit is None and (after.isalpha() or after == "_"):
            continue
        if unit is None and (range_end := _RANGE_END.match(text, m.end())):
            unit = range_end.group(1)
        found.append(Figure(m.group(1), _unit(unit)))
    return found


def sample_figures(block: str) -> list[Figure]:
    found = figures(block)
    for line in block.splitlines():
        row = _SUMMARY_ROW.search(line)
        if row and row["unit"] in _UNITS:
            found.append(Figure(row["baseline"], _UNITS[row["unit"]]))
    return found


def unmatched_figures(prose: str, block: str) -> list[str]:
    """Figures of `prose` that no number of `block` rounds to."""
    measured = sample_figures(block)
    prose = _CODE_SPAN.sub(" ", _LINK.sub(lambda m: m.group(1), prose))
    return [str(f) for f in figures(prose) if not any(f.rounds_from(m) for m in measured)]


def _lines_with_fences(markdown: str) -> list[tuple[str, str | None]]:
    """Each line with the language of the fenced block it belongs to (fences included):
    None outside blocks, "" for a block that names none."""
    lines, language = [], None
    for line in markdown.splitlines():
        fence = _FENCE.match(line)
        opens = fence is not None and language is None
        if opens:
            language = fence.group(1)
        lines.append((line, language))
        if fence and not opens:
            language = None
    return lines


def anchor_of(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a
    hyphen, "-N" added to the N-th repeat."""
    slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return f"{slug}-{count}" if count else slug


def sections(page: Path) -> list[Section]:
    """The page cut at every heading; text before the first heading is a section titled ""."""
    found, seen = [Section(page, "", "", [])], {}
    for line, language in _lines_with_fences(page.read_text()):
        heading = _HEADING.match(line) if language is None else None
        if heading:
            found.append(Section(page, heading.group(2), anchor_of(heading.group(2), seen), []))
        else:
            found[-1].lines.append((line, language))
    return found


def paragraphs(page: Path) -> list[str]:
    """Paragraphs and list items of a page, fenced blocks left out."""
    found, current = [], []
    for line, language in _lines_with_fences(page.read_text()):
        item = language is None and _LIST_ITEM.match(line)
        if language is not None or not line.strip() or item:
            found.append("\n".join(current))
            current = [line] if item else []
        else:
            current.append(line)
    return [p for p in found + ["\n".join(current)] if p]


def relative_links(page: Path) -> list[str]:
    return [m.group(2) for p in paragraphs(page) for m in _LINK.finditer(_CODE_SPAN.sub(" ", p))
            if not re.match(r"[a-z]+:", m.group(2))]


def resolve(page: Path, link: str) -> tuple[Path, str]:
    target, _, anchor = link.partition("#")
    return (page.parent / target if target else page).resolve(), anchor


SAMPLES = [s for page in PAGES for s in sections(page) if s.is_sample]


def test_readme_is_a_front_door():
    size = len(README.read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/ (limit {README_LIMIT_BYTES})"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    broken = []
    for link in relative_links(page):
        target, anchor = resolve(page, link)
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in {s.anchor for s in sections(target)}:
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_benchmark_page_quotes_its_samples():
    samples = [s for s in SAMPLES if s.page.name == "benchmarks.md"]
    assert samples, "docs/benchmarks.md has no 'Sample output' section"
    for s in samples:
        block, prose = s.sample_block_and_prose()
        assert block.strip(), f"{s.heading}: no fenced sample block"
        assert figures(prose), f"{s.heading}: no prose quoting the sample after its block"


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: f"{s.page.name}#{s.anchor}")
def test_prose_after_a_sample_quotes_the_sample(sample):
    block, prose = sample.sample_block_and_prose()
    wrong = unmatched_figures(prose, block)
    assert not wrong, f"{sample.page.name}, '{sample.heading}': figures not in its sample block: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paragraphs_citing_a_sample_quote_it(page):
    blocks = {(s.page.resolve(), s.anchor): s.sample_block_and_prose()[0] for s in SAMPLES}
    wrong = []
    for paragraph in paragraphs(page):
        for m in _LINK.finditer(paragraph):
            block = blocks.get(resolve(page, m.group(2)))
            if block is not None and (missing := unmatched_figures(paragraph, block)):
                wrong.append(f"{missing} (citing {m.group(2)})")
    assert not wrong, f"{page.name}: figures not in the sample they cite: " + "; ".join(wrong)


def test_a_wrong_figure_beside_a_sample_is_caught():
    block = ("crc32c  where     crc GB/s\navx512  in cache      69.4\n"
             "transfer crc32c avx512, in cache      69.37 GB/s    36.9  memcpy     1.88x")
    assert unmatched_figures("CRC32C runs at 69.4 GB/s in cache, 1.88x memcpy.", block) == []
    assert unmatched_figures("About 69 GB/s, 1.9x memcpy (36.9 GB/s).", block) == []
    assert unmatched_figures("CRC32C runs at 85 GB/s in cache.", block) == ["85 GB/s"]
    assert unmatched_figures("memcpy at 1.88 GB/s", block) == ["1.88 GB/s"]  # the ratio is no GB/s
    assert unmatched_figures("pack 1.1-1.4x copy", block) == ["1.1x", "1.4x"]
    assert unmatched_figures("p99, AES-128, sm_90, 64K on 2026-12-02 14:13, torch 2.13.0", block) == []


def _command_parser() -> argparse.ArgumentParser:
    """The parser `pddcore` builds, from the same table of subcommands."""
    cli = importlib.import_module("pddcore.cli")
    parser = argparse.ArgumentParser(prog="pddcore")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, _help) in cli.COMMANDS.items():
        importlib.import_module(module_name).add_arguments(sub.add_parser(name))
    return parser


_SEPARATOR_CHARS = set(";&|\n")  # between commands: ;, &&, ||, |, &, a new line
_WRAPPERS = {"sudo", "time"}


def _shell_commands(script: str) -> list[list[str]]:
    """The words of each command of a bash script (quotes may span lines, "\\" continues one)."""
    script = "\n".join(re.sub(r"(^|\s)#.*$", "", line) for line in script.replace("\\\n", " ").splitlines())
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|\n")
    lexer.whitespace, lexer.whitespace_split, lexer.commenters = " \t\r", True, ""
    commands, current = [], []
    for word in [*lexer, "\n"]:
        if not set(word) - _SEPARATOR_CHARS:
            while current and (current[0] in _WRAPPERS or re.match(r"\w+=", current[0])):
                current.pop(0)
            commands += [current] if current else []
            current = []
        else:
            current.append(word)
    return commands


def _documented_commands() -> list[tuple[str, str]]:
    """(page, arguments) of every `pddcore` command in the pages' bash blocks."""
    found = []
    for page in PAGES:
        script = "\n".join(line for line, language in _lines_with_fences(page.read_text())
                           if language in ("bash", "sh") and not _FENCE.match(line))
        found += [(page.name, shlex.join(words[1:])) for words in _shell_commands(script) if words[0] == "pddcore"]
    return found


@pytest.mark.parametrize("page,command", _documented_commands())
def test_documented_commands_parse(page, command):
    words = shlex.split(command)
    try:
        args = _command_parser().parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"{page}: `pddcore {command}` does not parse (exit {exc.code})")
    assert args.command == words[0]  # the subcommand the page names, not another one


_NEEDS_LINE = re.compile(r"#\s*needs:\s*(.*)$")


def _missing_gpu() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def _missing_root() -> str | None:
    from pddcore.testing.wan import unavailable_reason

    return unavailable_reason()


def _missing_rdma_nic() -> str | None:
    from pddcore.info import collect

    return None if collect()["rdma_devices"] else "no RDMA device"


# Each need a block may name, and what says why this machine lacks it (None: it has it).
NEEDS = {"gpu": _missing_gpu, "root": _missing_root, "rdma-nic": _missing_rdma_nic}


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    language: str
    line: int  # of the opening fence, 1-based
    code: str

    @property
    def needs(self) -> list[str]:
        first = self.code.split("\n", 1)[0]
        marker = _NEEDS_LINE.match(first.strip())
        return [n.strip() for n in marker.group(1).split(",")] if marker else []


def code_blocks(page: Path, languages: tuple[str, ...]) -> list[CodeBlock]:
    """The fenced blocks of `page` in one of `languages`, in page order."""
    found, current = [], None
    for number, (line, language) in enumerate(_lines_with_fences(page.read_text()), 1):
        if _FENCE.match(line):
            if current is None and language in languages:
                current = CodeBlock(page, language, number, "")
            elif current is not None:
                found.append(current)
                current = None
        elif current is not None:
            current = CodeBlock(page, current.language, current.line, current.code + line + "\n")
    return found


def runnable_script(blocks: list[CodeBlock]) -> tuple[str, list[str]]:
    """The blocks this machine can run, joined in order, and why each other block was left
    out. A need not in NEEDS raises ValueError."""
    kept, left_out = [], []
    for block in blocks:
        unknown = [n for n in block.needs if n not in NEEDS]
        if unknown:
            raise ValueError(f"{block.page.name}:{block.line}: unknown need(s) {unknown}; known: {sorted(NEEDS)}")
        missing = [reason for n in block.needs if (reason := NEEDS[n]()) is not None]
        if missing:
            left_out.append(f"{block.page.name}:{block.line}: " + "; ".join(missing))
        else:
            kept.append(block.code)
    return "\n".join(kept), left_out


PYTHON_PAGES = [page for page in PAGES if code_blocks(page, ("python",))]
# Pages whose blocks are still sketches (names they never define), with who makes them run.
# strict: the mark fails the run once the page runs, so it cannot outlive the sketches.
SHELL_PAGES = [page for page in PAGES if code_blocks(page, ("bash", "sh"))]


def test_pages_have_python_to_run():
    assert README in PYTHON_PAGES and len(PYTHON_PAGES) > 1, [p.name for p in PYTHON_PAGES]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path):
    script, left_out = runnable_script(code_blocks(page, ("python",)))
    if not script:
        pytest.skip("every block needs what this machine lacks: " + " | ".join(left_out))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, (f"{page.name}'s Python blocks failed (left out: {left_out or 'none'}):\n"
                                 f"{run.stderr[-3000:]}")


@pytest.mark.parametrize("page", SHELL_PAGES, ids=lambda p: p.name)
def test_shell_blocks_parse(page):
    wrong = []
    for block in code_blocks(page, ("bash", "sh")):
        check = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        if check.returncode != 0:
            wrong.append(f"block at line {block.line}: {check.stderr.strip()}")
    assert not wrong, f"{page.name}: " + "; ".join(wrong)


def test_a_block_needing_what_the_machine_lacks_is_left_out(tmp_path, monkeypatch):
    monkeypatch.setitem(NEEDS, "gpu", lambda: "no CUDA device")
    monkeypatch.setitem(NEEDS, "root", lambda: None)
    blocks = [CodeBlock(tmp_path / "p.md", "python", 3, "# needs: gpu\nimport cuda_thing\n"),
              CodeBlock(tmp_path / "p.md", "python", 9, "# needs: root\nx = 1\n"),
              CodeBlock(tmp_path / "p.md", "python", 14, "print(x)\n")]
    assert runnable_script(blocks) == ("# needs: root\nx = 1\n\nprint(x)\n", ["p.md:3: no CUDA device"])


def test_a_block_names_only_known_needs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\n# needs: gpu, rdma-nic\nx = 1\n```\n\n```python\n# needs: patience\ny = 2\n```\n")
    first, second = code_blocks(page, ("python",))
    assert first.needs == ["gpu", "rdma-nic"] and first.code.endswith("x = 1\n") and first.line == 1
    with pytest.raises(ValueError, match="patience"):
        runnable_script([first, second])
    script, left_out = runnable_script([CodeBlock(page, "python", 9, "print(1)\n")])
    assert script == "print(1)\n" and left_out == []


def test_a_broken_shell_block_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nif true; then echo ok\n```\n")
    (block,) = code_blocks(page, ("bash",))
    assert subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True).returncode != 0
