"""The docs as a reference: benchmarks.md one current table per benchmark, architecture.md placing every
module and C++ file, no work-log words in docs, bench/ or the packages' comments, benchmark pointers that
resolve."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "contract", "producer", "worker", "cli")
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BENCH_HELPERS = {"common.py", "grammar_schemas.py"}  # imported by benchmarks, not run on their own

# Work-log words: numbered work periods, helpers and waves, "the lead", "(H12)"-style worker tags, issue
# numbers. At least as strict as the pre-stop hook's `\b(session [0-9]|helper [A-Z]?[0-9]|\(H[0-9]{2}\)|the
# lead|wave [0-9])`: case-insensitive where it is not, "the lead" matches "the leader" as the hook's does.
WORK_LOG = re.compile(
    r"(?i:\b(?:sessions? [0-9]|helpers? [a-z]?[0-9]|the lead|waves? [0-9]|wave-[0-9]|issues? #?[0-9]"
    r"|work periods?\b))"
    r"|\([A-Z][0-9]{2}\)"
    r"|(?<![\w&])#[0-9]{1,4}\b"
)
DATED_HEADING = re.compile(r"^#+ .*\b20[0-9]{2}-[0-9]{2}-[0-9]{2}", re.M)
# Known work-log lines of engine/engine.py, (line text) — empty: nothing is allowed today.
KNOWN_WORK_LOG: set[tuple[str, str]] = set()

POINTER = re.compile(r'docs/benchmarks\.md,[\s#/]*(?:"([^"]+)"|([A-Za-z_]+)\b)')


def py_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and module/class/function docstring line of a Python source."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value,
                                                        ast.Constant) and isinstance(doc.value.value, str):
                found += [(doc.lineno + i, line) for i, line in enumerate(doc.value.value.splitlines())]
    return found


def c_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every `//` comment and every line inside `/* */` of a C++ source."""
    found, block = [], False
    for n, line in enumerate(source.splitlines(), 1):
        if block or "/*" in line:
            found.append((n, line))
            block = "*/" not in line.split("/*")[-1] if "/*" in line else "*/" not in line
        elif "//" in line:
            found.append((n, line[line.index("//"):]))
    return found


def package_sources() -> list[Path]:
    """Every .py, .cpp and .h file of the packages."""
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*") if p.suffix in (".py", ".cpp", ".h"))


def comment_lines(path: Path) -> list[tuple[int, str]]:
    """The comment and docstring lines of one package source."""
    source = path.read_text()
    return py_comments(source) if path.suffix == ".py" else c_comments(source)


def work_log_hits(lines: list[tuple[int, str]], where: str) -> list[str]:
    """`where:line: text` for every line with a work-log word."""
    return [f"{where}:{n}: {text.strip()}" for n, text in lines if WORK_LOG.search(text)]


def sections(markdown: str, level: str = "## ") -> dict[str, str]:
    """Heading → body of every section at `level` (text up to the next heading of that level or above)."""
    parts = re.split(rf"^{level}(.+)$", markdown, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_the_work_log_pattern_catches_what_the_hook_catches_and_issue_numbers():
    for text in ("session 7", "Session 4, the lead's rerun", "helper H7", "helper 3", "(H12)", "the leader",
                 "wave 3", "Wave 2's engine", "issue 26", "issues 30, 26", "see #12", "work period"):
        assert WORK_LOG.search(text), text
    for text in ("a dashboard session id", "the helpers of the kernels", "f(x01)", "_MM_SHUFFLE(1, 0)",
                 "# 2 rows",
                 "a waveform", "the issue's target", "leading rows"):
        assert not WORK_LOG.search(text), text


def test_no_work_log_words_in_docs_readme_or_bench():
    docs = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
            *sorted((ROOT / "bench").rglob("*.py"))]
    assert len(docs) > 10
    hits = [hit for path in docs
            for hit in work_log_hits(list(enumerate(path.read_text().splitlines(), 1)),
                                     str(path.relative_to(ROOT)))]
    assert hits == []
    dated = [f"{path.name}: {m.group(0)}" for path in docs if path.suffix == ".md"
             for m in DATED_HEADING.finditer(path.read_text())]
    assert dated == []


def test_no_work_log_words_in_the_packages_comments_and_docstrings():
    hits = []
    for path in package_sources():
        rel = str(path.relative_to(ROOT))
        hits += [h for h in work_log_hits(comment_lines(path), rel)
                 if (rel, h.split(": ", 1)[1]) not in KNOWN_WORK_LOG]
    assert hits == []
    sample = "x = 1  # measured in session 7\n\ndef f():\n    '''As issue 26 asked.'''\n"
    assert [n for n, _ in py_comments(sample) if WORK_LOG.search(_)] == [1, 4]
    assert c_comments("int a;  // wave 3\n/* one\n   two */ int b;\n") == [
        (1, "// wave 3"), (2, "/* one"), (3, "   two */ int b;")]


def test_benchmarks_md_is_one_current_table_per_benchmark_with_command_cpu_and_date():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= 600
    tables = {title: body for title, body in sections(text).items() if re.search(r"^\|", body, re.M)}
    assert len(tables) >= 15
    missing = []
    for title, body in tables.items():
        head = body.split("\n|", 1)[0]  # what precedes the section's first table
        if not re.search(r"`[^`]*\bpython\s[^`]+`", head):
            missing.append(f"{title}: no command")
        if not re.search(r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", head):
            missing.append(f"{title}: no date")
        if "CPU: " not in head:
            missing.append(f"{title}: no CPU")
    assert missing == []


def test_every_benchmark_script_is_in_benchmarks_md():
    text = BENCHMARKS.read_text()
    scripts = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if p.name not in BENCH_HELPERS]
    assert len(scripts) >= 15
    assert [s for s in scripts if f"bench/{s}" not in text] == []


def test_pointers_into_benchmarks_md_name_a_section_or_a_benchmark():
    headings = [re.sub(r"\s+", " ", h) for h in sections(BENCHMARKS.read_text())]
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    broken, seen = [], 0
    for path in package_sources():
        for quoted, name in POINTER.findall(path.read_text()):
            seen += 1
            title = re.sub(r"\s+", " ", re.sub(r"\n\s*(#|//)?", " ", quoted)).strip()
            if (quoted and not any(h.startswith(title) for h in headings)) or (name and name not in scripts):
                broken.append(f"{path.relative_to(ROOT)}: {title or name}")
    assert seen >= 10
    assert broken == []


def test_architecture_md_draws_the_request_path_first():
    text = ARCHITECTURE.read_text()
    figure = text.split("```")[1]
    steps = ["producer/client", "producer/sharding", "Redis", "worker/worker.EngineWorker",
             "worker/shard_run.ShardRun", "LLM.add_request", "engine/engine.Engine.step",
             "contract/storage", "worker/finalize", "worker/webhooks"]
    places = [figure.find(step) for step in steps]
    assert -1 not in places, [s for s, p in zip(steps, places, strict=True) if p < 0]
    assert places == sorted(places)
    assert "run_shard" not in figure  # rq's stock worker's job function; `sluice worker` does not call it


def test_architecture_md_places_every_module_and_cpp_file():
    package_text = {title.split("/")[0]: body for title, body in sections(ARCHITECTURE.read_text()).items()
                    if title.split("/")[0] in PACKAGES}
    assert sorted(package_text) == sorted(PACKAGES)
    unplaced = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if f"`{path.relative_to(ROOT / pkg)}`" not in package_text[pkg]:
                unplaced.append(str(path.relative_to(ROOT)))
    csrc = sorted((ROOT / "kernels" / "csrc").iterdir())
    assert len(csrc) >= 31
    unplaced += [f"kernels/csrc/{p.name}" for p in csrc if f"`{p.name}`" not in package_text["kernels"]]
    assert unplaced == []


def test_architecture_md_lines_fit_110_characters():
    assert [n for n, line in enumerate(ARCHITECTURE.read_text().splitlines(), 1) if len(line) > 110] == []
