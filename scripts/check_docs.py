"""Check that the docs reproduce: re-run every documented command and compare its output.

The docs are doc/*.md and README.md.

    python scripts/check_docs.py --lint          # structure, names, sentence length, no runs
    python scripts/check_docs.py --ci            # the blocks marked ci (tiny runs; CI runs these)
    python scripts/check_docs.py --all           # every documented command (about 15 minutes)
    python scripts/check_docs.py --all -k 04_    # the blocks whose file or command contains 04_

The convention (doc/design.md, "Docs that reproduce"):

- An output block is a ```text fence. It must follow a ```bash fence (only blank lines
  between) that holds the command(s) that printed it, with every flag they were run with.
  The commands run in order, from the repository root, in ``bash -e``; the output searched is
  their stdout followed by their stderr.
- An HTML comment ``<!-- check: OPTIONS -->`` just before the ```bash fence sets options,
  separated by spaces: ``ci`` (run by --ci too: keep it tiny), ``fails`` (the command must
  exit non-zero), ``timing-columns=NAME,NAME`` (table columns, named by their header, whose
  values are timings; counted from the header's nearer end).
- An output block may be an excerpt. A line ``...`` skips any number of output lines; ``...``
  inside a line matches any text. Between two ``...`` lines the doc's lines must match
  consecutive output lines, so a row that appears or disappears is drift.
- Timing is ignored by rule: numbers followed by tok/s, ms, s or %, dates, ``runs/...`` paths
  and the measured bubble are masked; chart lines (``|====  ##  ..|``), torchrun's log
  lines and the Trainer's straggler lines (a loaded machine prints one in a healthy run) are
  skipped. Deviations printed as d.de-XX (rounding-level, they vary with the CPU's
  instruction set) match within a factor of 3, and the weight named beside one is masked.
  Blank lines are skipped. A tolerance derived from a measured floor (``tolerance 9.6e-05 =
  32 x floor 3.0e-06``) is a deviation too. Everything else (parity verdicts and tolerances,
  ledger elements and bytes, memory tables, the rank grid, formula lines) must be equal.
- A ``scripts/launch.sh`` command in a checked block must pass ``--steps``.
- An output block shows the command's last lines: it may not end with ``...``, and its last
  lines must be the output's last lines (of stdout, or of stdout and stderr together).
- --lint also checks the names a page gives (scripts/doc_names.py): every path, module,
  function, class and flag exists, and "the picture above" (or below) is where it says.
- A source excerpt is a ```python fence right after ``<!-- excerpt: FILE NAME -->``: its lines
  must equal FILE's lines between ``# [core: NAME]`` and ``# [end: NAME]`` (markers left out,
  common indentation removed), so code shown on a page cannot drift from the code that runs.
- A plain ``` fence that looks like program output (a parity line, a ledger header...) is an
  error: label it ```text and put its command before it.
- A prose sentence has at most 30 words in a chapter page (doc/NN_*.md) and the README
  (CHAPTER_WORDS), 40 elsewhere (MAX_WORDS): a learner reads prose, so --lint counts it.
  Fences, indented blocks, tables (a list item's too), headings, HTML comments and images
  are not prose. A sentence ends at ``. ! ? : ;`` followed by a space and a capital, a
  backtick, ``(`` or ``*``; a blank line or a list item's marker starts a new one. A word is a
  run of non-spaces with a letter in it, so numbers and symbols do not count.

Exit status 1 and a diff (``-`` the doc, ``+`` the output) on any drift or structure error.
"""

import concurrent.futures
import difflib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scaletorch.rules.errors import OneLineParser  # noqa: E402  # isort: skip
from scripts.doc_names import page_errors  # noqa: E402  # isort: skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ELLIPSIS = "..."
FACTOR = 3.0  # how far a rounding-level deviation (d.de-XX) may move between machines

# Timing tokens, masked in the doc and in the output alike.
MASKS: List[Tuple[re.Pattern, str]] = [
    (re.compile(r"\d{4}-\d{2}-\d{2}[T _]\d{2}:\d{2}(:\d{2}(\.\d+)?)?"), "<date>"),
    (re.compile(r"[\d,]+(\.\d+)?\s*tok/s"), "<tok/s>"),
    (re.compile(r"\d+(\.\d+)?\s*ms\b"), "<ms>"),
    (re.compile(r"(?<![\w.])\d+(\.\d+)?\s*(s|sec|seconds)\b(?!/)"), "<s>"),
    (re.compile(r"\d+(\.\d+)?\s*%"), "<%>"),
    (re.compile(r"bubble: measured [\d.]+"), "bubble: measured <t>"),
    (re.compile(r"\bruns/[^\s'\"),]+"), "<run>"),
    # the weight a rounding-level deviation is largest in moves with the CPU, as the deviation
    (re.compile(r"(\d\.\de[-+]\d\d after \d+ steps, in )[\w.]+"), r"\1<param>"),
]
# Lines that are timing as a whole: charts drawn from a clock, torchrun's own log lines.
SKIP = [
    re.compile(r"\|[=#. a-zA-Z0-9]{10,}\|"),  # 0-9: the zero-bubble schedules' W
    re.compile(r"^[WIEF]\d{4} \d{2}:\d{2}:\d{2}"),
    re.compile(r"^straggler: rank \d+ is busy"),
]
SCI = re.compile(r"\d\.\de[-+]\d\d")
# What ScaleTorch's scripts print: a plain fence holding one of these is unlabeled output.
OUTPUT_SIGNS = re.compile(r"^(parity: max|communication per rank|op\s+group\s+N\s+calls|"
                          r"rank grid: world|step\s+\d+ \| loss|bubble: measured|final loss|"
                          r"(all_reduce|all_gather|reduce_scatter|all_to_all|send|recv)\s+\w+"
                          r"\s+\d+\s+\d+|(bucket \d+|forward\+backward|stage \d+|rank \d+)\s+\||"
                          r"routing of the last|RuntimeError: rank)")
# A --check run of a language-model chapter: its last line is the gradient norms' parity.
LANGUAGE_CHECK = re.compile(r"examples/(0\d|10|11)\w*\.py .*--check")
FENCE = re.compile(r"^```\s*(\S*)\s*$")
MAX_WORDS = 40
CHAPTER_WORDS = 30  # a chapter page (doc/NN_*.md) and the README: what a learner reads first
CHAPTER_PAGE = re.compile(r"^(\d\d[a-z]?_.*|README)\.md$")
NOT_PROSE = ("    ", "\t", "#", "<!--", "![")  # and a table's row, indented or not
LIST_MARKER = re.compile(r"^\s*([-*]|\d+\.)\s+")
SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z(`*])")
MARKER = re.compile(r"^<!--\s*check:(.*?)-->\s*$")
EXCERPT = re.compile(r"^<!--\s*excerpt:\s*(\S+)\s+(\S+)\s*-->\s*$")


@dataclass
class Block:
    """A command block and the output block under it."""
    path: str
    line: int  # 1-based line of the ```bash fence
    commands: List[str]
    expected: List[str]
    options: Dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


@dataclass
class Fence:
    info: str
    start: int  # 0-based index of the opening line
    lines: List[str]
    marker: Optional[str]  # the options of a <!-- check: --> comment just before it


def _fences(text: str) -> List[Fence]:
    lines = text.splitlines()
    fences, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        fences.append(Fence(m.group(1), i, lines[i + 1:j], marker and marker.group(1)))
        i = j + 1
    return fences


def source_excerpt(path: str, name: str) -> Optional[List[str]]:
    """The lines of ``path`` (from the repository root) between ``# [core: name]`` and
    ``# [end: name]``, without the markers and the blank lines next to them, dedented (lines
    inside a function start at column 0); None if the file or a marker is missing."""
    full = os.path.join(ROOT, path)
    if not os.path.isfile(full):
        return None
    with open(full, encoding="utf-8") as f:
        lines = f.read().splitlines()
    marks = [
        i for i, line in enumerate(lines)
        if line.strip() in (f"# [core: {name}]", f"# [end: {name}]")
    ]
    if len(marks) != 2:
        return None
    body = textwrap.dedent("\n".join(lines[marks[0] + 1:marks[1]]))  # a method's lines at 0
    return body.strip("\n").splitlines()  # no blank ends


def excerpt_errors(rel: str, lines: List[str], fences: List[Fence]) -> List[str]:
    """A page's source excerpts that differ from their source (or name none)."""
    errors = []
    for fence in fences:
        k = fence.start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        match = EXCERPT.match(lines[k].strip()) if k >= 0 else None
        if match is None:
            continue
        where = f"{rel}:{fence.start + 1}"
        source = source_excerpt(match.group(1), match.group(2))
        if source is None:
            errors.append(f"{where}: excerpt of {match.group(1)} '{match.group(2)}': no such "
                          f"file, or not one '# [core: {match.group(2)}]' ... '# [end: ...]' pair")
        elif [line.rstrip() for line in textwrap.dedent("\n".join(fence.lines)).splitlines()] \
                != [line.rstrip() for line in source]:  # shown at either indentation
            diff = difflib.unified_diff(fence.lines, source, "page", match.group(1), lineterm="")
            errors.append(f"{where}: excerpt differs from {match.group(1)} (update the page):\n" +
                          "\n".join(list(diff)[2:]))
    return errors


def _adjacent(lines: List[str], a: Fence, b: Fence) -> bool:
    """True when only blank lines separate the end of fence ``a`` from the start of ``b``."""
    end = a.start + len(a.lines) + 1
    return all(not line.strip() for line in lines[end + 1:b.start])


def _commands(lines: List[str]) -> List[str]:
    """Shell commands of a bash block: backslash continuations joined, comments dropped."""
    out, current = [], ""
    for line in lines:
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        out.append(current + stripped)
        current = ""
    if current:
        out.append(current.strip())
    return out


def _options(marker: Optional[str]) -> Dict[str, str]:
    opts = {}
    for word in (marker or "").split():
        key, _, value = word.partition("=")
        opts[key] = value
    return opts


def parse(path: str, text: Optional[str] = None) -> Tuple[List[Block], List[str]]:
    """The command/output blocks of one markdown file, and its structure errors."""
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    lines = text.splitlines()
    rel = os.path.relpath(path, ROOT)
    fences = _fences(text)
    blocks, errors = [], []
    for i, fence in enumerate(fences):
        prev = fences[i - 1] if i > 0 else None
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        where = f"{rel}:{fence.start + 1}"
        if fence.info == "text":
            if prev is None or prev.info != "bash" or not _adjacent(lines, prev, fence):
                errors.append(f"{where}: output block without its command (put a ```bash block "
                              f"with the exact command right before it)")
        elif fence.info == "bash":
            has_output = nxt is not None and nxt.info == "text" and _adjacent(lines, fence, nxt)
            if fence.marker is not None and not has_output:
                errors.append(f"{where}: a check marker but no ```text output block after it")
            if not has_output:
                continue
            commands = _commands(fence.lines)
            if not commands:
                errors.append(f"{where}: empty command block")
                continue
            for command in commands:
                if "scripts/launch.sh examples/" in command and "--steps" not in command:
                    errors.append(f"{where}: '{command}' does not say its --steps")
            blocks.append(Block(path, fence.start + 1, commands, nxt.lines, _options(fence.marker)))
        elif fence.info == "":
            for line in fence.lines:
                if OUTPUT_SIGNS.match(line.strip()):
                    errors.append(f"{where}: looks like program output ('{line.strip()[:40]}'): "
                                  f"label it ```text and put its command before it")
                    break
    return blocks, errors + excerpt_errors(rel, lines, fences)


def elided_ends(path: str) -> List[str]:
    """One error per output block that ends with '...': a block shows the command's last
    lines (a verdict or an error there is part of the claim)."""
    errors = []
    for block in parse(path)[0]:
        shown = [line for line in block.expected if line.strip()]
        if shown and shown[-1].strip() == ELLIPSIS:
            errors.append(f"{block.name}: the output ends with '...': show the command's last "
                          f"lines")
        elif shown and shown[-1].startswith("parity: max |weight") and "fails" not in \
                block.options and LANGUAGE_CHECK.search(block.commands[-1]):
            errors.append(f"{block.name}: a --check run ends with the gradient norms' parity "
                          f"line, after the weights' (trainer/parity.py)")
    return errors


def word_limit(path: str) -> int:
    """How many words a prose sentence of ``path`` may have."""
    return CHAPTER_WORDS if CHAPTER_PAGE.match(os.path.basename(path)) else MAX_WORDS


def long_sentences(path: str, text: Optional[str] = None, limit: Optional[int] = None) -> List[str]:
    """One error per prose sentence of more than ``limit`` words (by default ``word_limit``),
    with the line where its paragraph starts and its first words."""
    limit = word_limit(path) if limit is None else limit
    if text is None:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    rel = os.path.relpath(path, ROOT)
    # paragraphs of prose: (line where it starts, its text); code, tables, headings break them
    paragraphs: List[Tuple[int, str]] = []
    current: List[str] = []
    start, in_fence = 0, False

    def close() -> None:
        if current:
            paragraphs.append((start, " ".join(current)))
            current.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            close()
            continue
        if in_fence or not line.strip() or line.startswith(NOT_PROSE) or line.lstrip()[:1] == "|":
            close()
            continue
        if LIST_MARKER.match(line):
            close()
            line = LIST_MARKER.sub("", line)
        if not current:
            start = number
        current.append(line.strip())
    close()
    errors = []
    for number, paragraph in paragraphs:
        for sentence in SENTENCE_END.split(paragraph):
            words = [w for w in sentence.split() if re.search(r"[A-Za-z]", w)]
            if len(words) > limit:
                errors.append(f"{rel}:{number}: a sentence of {len(words)} words (at most "
                              f"{limit}): '{sentence[:60]}...'")
    return errors


# --- comparison ------------------------------------------------------------------------------


def normalize(line: str) -> Optional[str]:
    """The line with its timing masked, or None when the whole line is timing or blank (a
    blank line says nothing, and one separates a block's stdout from its stderr)."""
    line = line.rstrip()
    if not line or any(p.search(line) for p in SKIP):
        return None
    for pattern, repl in MASKS:
        line = pattern.sub(repl, line)
    return line


def _column_of(span: Tuple[int, int], header: List[Tuple[str, int, int]]) -> str:
    """The header field a row's token at ``span`` (characters) sits under: a field's column
    runs from its start to the next field's start, and the token's middle decides (a text
    column is left-aligned, a number under a longer header right-aligned)."""
    middle = (span[0] + span[1] - 1) / 2
    column = header[0][0]
    for name, start, _ in header:
        if start <= middle:
            column = name
    return column


def _mask_columns(lines: List[str], names: Sequence[str]) -> List[str]:
    """Replace the named columns' values by <t> in the rows under the header that names them.

    In an aligned table (the header and the row hold a run of two spaces), a token belongs to
    the header field above it, so a column with spaces (a benchmark's name, a list of
    arguments, a target such as "<= 1.2") shifts nothing. Otherwise whitespace-separated
    fields, counted from the header's nearer end: a column in its right half is counted from
    the right, so that a column with spaces on its other side does not shift it.
    """
    if not names:
        return lines
    out, positions = [], None
    header: List[Tuple[str, int, int]] = []
    for line in lines:
        fields = line.split()
        if all(n in fields for n in names):
            width = len(fields)
            positions = [i if i < width / 2 else i - width for i in map(fields.index, names)]
            header = [(m.group(), m.start(), m.end()) for m in re.finditer(r"\S+", line)]
            header = header if "  " in line.strip() else []
            out.append(" ".join(fields))
        elif positions is not None and len(fields) > 1:
            if header and "  " in line.strip():
                fields = [
                    "<t>" if _column_of(m.span(), header) in names else m.group()
                    for m in re.finditer(r"\S+", line)
                ]
            else:  # timing units masked first (a "(76 s)" line is not a row)
                fields = (normalize(line) or "").split()
                for i in positions:
                    if len(fields) > 1 and -len(fields) <= i < len(fields):
                        fields[i] = "<t>"
            out.append(" ".join(fields))
        else:
            out.append(line)
    return out


def prepare(lines: Sequence[str], timing_columns: Sequence[str] = ()) -> List[str]:
    # the columns first, while the table is still aligned
    masked = _mask_columns([line.rstrip() for line in lines], timing_columns)
    return [n for n in (normalize(line) for line in masked) if n is not None]


def _line_pattern(doc: str) -> Tuple[re.Pattern, List[str]]:
    parts, numbers, pos = [], [], 0
    for m in re.finditer(r"\.\.\.|" + SCI.pattern, doc):
        parts.append(re.escape(doc[pos:m.start()]))
        if m.group() == ELLIPSIS:
            parts.append(".*?")
        elif doc[:m.start()].endswith("tolerance ") and not doc[m.end():].startswith(" = "):
            parts.append(re.escape(m.group()))  # a tolerance is a setting: exact
            # (one "= 32 x floor ..., measured this run" is a measurement: it may move)
        else:
            parts.append(f"({SCI.pattern})")
            numbers.append(m.group())
        pos = m.end()
    parts.append(re.escape(doc[pos:]))
    return re.compile("".join(parts)), numbers


def line_matches(doc: str, out: str) -> bool:
    """One doc line against one output line (both prepared)."""
    if doc == out:
        return True
    pattern, numbers = _line_pattern(doc)
    m = pattern.fullmatch(out)
    if not m:
        return False
    for expected, got in zip(numbers, m.groups()):
        a, b = float(expected), float(got)
        if a == b:
            continue
        if a <= 0 or b <= 0 or max(a / b, b / a) > FACTOR:
            return False
    return True


def _segments(doc: List[str]) -> List[List[str]]:
    segments, current = [], []
    for line in doc:
        if line.strip() == ELLIPSIS:
            if current:
                segments.append(current)
            current = []
        else:
            current.append(line)
    if current:
        segments.append(current)
    return segments


def compare(doc_lines: Sequence[str], output: str, timing_columns: Sequence[str] = (),
            stdout: Optional[str] = None) -> List[str]:
    """Diff lines ('-' doc, '+' output) for the parts of the doc block the output lacks; [] if
    the output reproduces the block. Unless the block ends with '...', its last lines must be
    the last lines of ``output`` (or of ``stdout``, the part of it before stderr)."""
    doc = prepare(doc_lines, timing_columns)
    out = prepare(output.splitlines(), timing_columns)
    diff = _diff_segments(doc, out)
    if diff or not doc or doc[-1].strip() == ELLIPSIS:
        return diff
    # the block's last lines are the output's last lines: of all of it, or of its stdout
    last = _segments(doc)[-1]
    ends = [out[-len(last):]]
    if stdout is not None:
        ends.append(prepare(stdout.splitlines(), timing_columns)[-len(last):])
    if any(
            len(end) == len(last) and all(line_matches(d, o) for d, o in zip(last, end))
            for end in ends):
        return []
    return list(
        difflib.unified_diff(last, ends[0], "doc (its last lines)", "output (its last lines)",
                             lineterm="", n=len(last)))


def _diff_segments(doc: List[str], out: List[str]) -> List[str]:
    pos, diff = 0, []
    for seg in _segments(doc):
        found = None
        for start in range(pos, len(out) - len(seg) + 1):
            if all(line_matches(d, o) for d, o in zip(seg, out[start:start + len(seg)])):
                found = start
                break
        if found is not None:
            pos = found + len(seg)
            continue
        # the closest window of the output, to show what changed
        best, best_score = pos, -1.0
        for start in range(pos, max(pos + 1, len(out) - len(seg) + 1)):
            window = out[start:start + len(seg)]
            score = sum(difflib.SequenceMatcher(None, d, o).ratio() for d, o in zip(seg, window))
            if score > best_score:
                best, best_score = start, score
        window = out[best:best + len(seg)]
        diff.extend(difflib.unified_diff(seg, window, "doc", "output", lineterm="", n=len(seg)))
    return diff


# --- running ---------------------------------------------------------------------------------


def overwriting(command: str) -> str:
    """``command`` with ``--overwrite`` among a launched script's arguments (unless it resumes):
    the docs rerun each chapter's run name, which a run refuses without it (it moves the last
    run aside, runs/NAME.old-<time>)."""
    if not command.startswith("scripts/launch.sh examples/") or "resume" in command:
        return command
    return command.replace(" -- ", " -- --overwrite ", 1)


def in_run_dir(command: str, runs: str) -> str:
    """``command`` writing its runs under directory ``runs`` instead of the checkout's runs/: a
    launched script that reads the config (load_config) gets ``--logging.run_dir runs``, and
    any other command's ``runs/`` path points there too."""
    script = command.split()[1] if command.startswith("scripts/launch.sh ") else ""
    if script and os.path.isfile(os.path.join(ROOT, script)):
        with open(os.path.join(ROOT, script)) as f:
            if "load_config" in f.read():
                command = command.replace(" -- ", f" -- --logging.run_dir {runs} ", 1) \
                    if " -- " in command else f"{command} -- --logging.run_dir {runs}"
    return re.sub(r"(?<![\w/.])runs/", runs + "/", command)


def run_block(block: Block, timeout: float) -> Tuple[int, str, str]:
    """Run the block's commands from the repository root, their runs in a temporary directory
    (the checkout keeps no run: the README's first command must find its name free);
    (exit status, stdout, stderr), with that directory shown as runs/. The last command of a
    block that must fail runs as written (but for the directory): it may show that refusal."""
    commands = [overwriting(c) for c in block.commands]
    if "fails" in block.options:
        commands[-1] = block.commands[-1]
    with tempfile.TemporaryDirectory() as tmp:
        runs = os.path.join(tmp, "runs")
        script = "set -e\n" + "\n".join(in_run_dir(c, runs) for c in commands) + "\n"
        proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
            stdout, stderr = proc.communicate()
            stderr += f"\ncheck_docs: timed out after {timeout:.0f} s"
            return -1, stdout.replace(runs, "runs"), stderr.replace(runs, "runs")
    return proc.returncode, stdout.replace(runs, "runs"), stderr.replace(runs, "runs")


def check_block(block: Block, timeout: float,
                run: Callable[[Block, float], Tuple[int, str, str]] = run_block) -> List[str]:
    """Problems of one block (empty when it reproduces); ``run`` runs its commands: (exit
    status, stdout, stderr), by default ``run_block`` (bash, from the repository root)."""
    code, stdout, stderr = run(block, timeout)
    fails = "fails" in block.options
    if (code != 0) != fails:
        lines = (stdout + stderr).splitlines()
        errors = [line for line in lines if re.search(r"\w*Error\b|^error:", line)][:3]
        want = "a non-zero exit" if fails else "exit 0"
        return [
            f"exit status {code}, the doc expects {want}; the errors and last lines:", *errors,
            *lines[-10:]
        ]
    columns = [c for c in block.options.get("timing-columns", "").split(",") if c]
    return compare(block.expected, stdout + "\n" + stderr, columns, stdout)


def doc_files(names: Sequence[str]) -> List[str]:
    if names:
        return [os.path.abspath(n) for n in names]
    return sorted(glob.glob(os.path.join(ROOT, "doc", "*.md"))) + [os.path.join(ROOT, "README.md")]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lint", action="store_true",
                      help="check the structure and sentence length only, run nothing")
    mode.add_argument("--ci", action="store_true", help="run the blocks marked ci")
    mode.add_argument("--all", action="store_true", help="run every documented command")
    parser.add_argument("-k", dest="pattern", default="",
                        help="only the blocks whose file or command contains this")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per block")
    parser.add_argument("--jobs", type=int, default=1,
                        help="blocks run at once (the ci blocks write different run dirs)")
    parser.add_argument("files", nargs="*", help="markdown files (default: doc/*.md, README.md)")
    args = parser.parse_args(argv)

    blocks, errors = [], []
    for path in doc_files(args.files):
        found, problems = parse(path)
        blocks += found
        errors += problems
        if args.lint:
            errors += long_sentences(path) + page_errors(path) + elided_ends(path)
    for error in errors:
        print(f"STRUCTURE {error}")
    if args.lint:
        print(f"{len(blocks)} command blocks with output, {len(errors)} structure errors "
              f"(sentences of more than {CHAPTER_WORDS} words in a chapter page or the README, "
              f"{MAX_WORDS} elsewhere, included)")
        return 1 if errors else 0

    def wanted(b: Block) -> bool:
        named = args.pattern in b.name or any(args.pattern in c for c in b.commands)
        return (args.all or "ci" in b.options) and named

    selected = [b for b in blocks if wanted(b)]
    if args.jobs < 1:
        parser.error(f"--jobs takes a number of blocks >= 1, got {args.jobs}")
    failed, start = 0, time.time()

    def timed(block: Block) -> Tuple[List[str], float]:
        t0 = time.time()
        return check_block(block, args.timeout), time.time() - t0

    # Most of a tiny run is process start-up and waiting, so two at once share 2 cores well.
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for block, (problems, seconds) in zip(selected, pool.map(timed, selected)):
            verdict = "DRIFT" if problems else "ok"
            print(f"{verdict:5s} {block.name}  ({seconds:.0f} s)  {block.commands[-1]}", flush=True)
            for line in problems:
                print(f"      {line}")
            failed += bool(problems)
    print(f"{len(selected) - failed} reproduced, {failed} drifted, {len(errors)} structure "
          f"errors ({time.time() - start:.0f} s)")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
