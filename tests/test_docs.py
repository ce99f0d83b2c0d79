"""The docs cite only what the repository holds: make targets the Makefile has, links to
committed files, no design papers of the founding team (METHODS.md, NOTES.md, ARCHITECTURE.md,
STYLE.md, which are not in the repository), no path to a .md file or section that is not
committed; and `make clean` removes only what it should."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "bench" / "RESULTS.md"]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?<![\w./-])make\s+([a-z][\w-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FOREIGN = re.compile(r"\b(METHODS|NOTES|ARCHITECTURE|STYLE)(\.md\b|\s*§)")


def code_of(text: str) -> list[str]:
    """What a doc shows as code: its fenced blocks and its inline code spans."""
    blocks = FENCE.findall(text)
    return blocks + SPAN.findall(FENCE.sub("", text))


def makefile_targets(makefile: Path) -> set[str]:
    """Targets the Makefile defines (`name:` at the start of a line, not `NAME :=`)."""
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", makefile.read_text(), re.M))


def committed() -> set[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no way to tell committed files")
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return set(out.stdout.splitlines())


def test_the_doc_checks_see_what_they_check():
    """The parsers on a small sample (a test that cannot fail is a defect)."""
    sample = (
        "Run `make demo` or\n```bash\nmake train RUN=x   # then make evaluate\n```\n"
        "a make target in prose; see [a](a.md#x), ![b](../b.png), [web](https://x.org)."
    )
    found = {m for code in code_of(sample) for m in MAKE.findall(code)}
    assert found == {"demo", "train", "evaluate"}
    assert LINK.findall(sample) == ["a.md#x", "../b.png", "https://x.org"]
    assert FOREIGN.search("see METHODS.md §3") and FOREIGN.search("(METHODS §2)")
    assert not FOREIGN.search("docs/methods.md §2, docs/architecture.md")
    assert {"clean", "test-gpu", "help"} <= makefile_targets(REPO / "Makefile")
    assert not {"SHELL", "PY", "ROOT"} & makefile_targets(REPO / "Makefile")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_a_doc_names_exists(doc):
    targets = makefile_targets(REPO / "Makefile")
    named = {m for code in code_of(doc.read_text()) for m in MAKE.findall(code)}
    assert not named - targets, f"{doc.name} names make targets the Makefile lacks"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_a_committed_file(doc):
    files = committed()
    folders = {str(Path(f).parent) for f in files}
    bad = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"^[a-z][\w+.-]*:", target) or target.startswith("#"):
            continue  # a web address, or a place in this page
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.is_relative_to(REPO):
            bad.append(target)
            continue
        rel = path.relative_to(REPO).as_posix()
        if rel not in files and rel not in folders:
            bad.append(target)
    assert not bad, f"{doc.name} links to files that are not committed: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_doc_cites_the_founding_teams_papers(doc):
    """METHODS.md, NOTES.md and ARCHITECTURE.md are not in the repository: docs/methods.md and
    docs/architecture.md say what users need."""
    cites = [m.group(0) for m in FOREIGN.finditer(doc.read_text())]
    assert not cites, f"{doc.name} cites {cites}"


# Where the code cites a section of one of the repository's docs: `docs/methods.md §3`,
# `docs/methods.md §4-5`, `docs/methods.md §4-§5`.
OWN_SECTION = re.compile(r"(docs/[\w/-]+\.md) §(\d+)(?:-§?(\d+))?")
# A section with no file before it on its line, `(§4)`, is one of docs/methods.md (the one doc
# with numbered sections) unless a paper is named before it (`Kumar et al. 2019, §5`).
BARE_SECTION = re.compile(r"(?<!\.md )§(\d+)(?:-§?(\d+))?")
PAPER = re.compile(r"et al\.|\.md\b")
# A path to a Markdown file under one of the repository's top folders (`docs/compat.md`,
# `bench/RESULTS.md`); an output a stage writes (`eval/report.md`) starts with no such folder.
MD_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w.-]+\.md)\b")


def sections(page: str) -> set[int]:
    """The numbered sections of a doc (`## 3. CSM training`), empty if it has none or is missing."""
    path = REPO / page
    text = path.read_text() if path.is_file() else ""
    return {int(n) for n in re.findall(r"^## (\d+)\.", text, re.M)}


def methods_sections() -> set[int]:
    return sections("docs/methods.md")


def cited_sections(text: str) -> list[tuple[str, str, int, int]]:
    """(what the text says, the doc, first and last section) of every section citation: a
    doc's own path, else docs/methods.md for a bare `§N` in code that names no paper."""
    found = []
    for line in text.splitlines():
        for m in OWN_SECTION.finditer(line):
            first, last = int(m.group(2)), int(m.group(3) or m.group(2))
            found.append((m.group(0), m.group(1), first, last))
        for m in BARE_SECTION.finditer(line):
            if not PAPER.search(line[: m.start()]):
                first, last = int(m.group(1)), int(m.group(2) or m.group(1))
                found.append((m.group(0), "docs/methods.md", first, last))
    return found


def uncommitted_md_paths(text: str, files: set[str]) -> list[str]:
    """Paths to .md files under a top folder of the repository that are not committed."""
    tops = {f.split("/", 1)[0] for f in files if "/" in f}
    return [
        m.group(1)
        for m in MD_PATH.finditer(text)
        if m.group(1).split("/", 1)[0] in tops and m.group(1) not in files
    ]


def test_the_citation_patterns_see_what_they_check():
    assert FOREIGN.search("as in METHODS §2") and FOREIGN.search("see ARCHITECTURE.md")
    assert not FOREIGN.search("pipeline/study/config.py METHODS[m]")
    assert FOREIGN.search("see STYLE.md") and not FOREIGN.search("a STYLE of its own")
    cited = cited_sections("(docs/methods.md §4-§5), docs/methods.md §2\nthe sampler (§3)")
    assert [(doc, a, b) for _, doc, a, b in cited] == [
        ("docs/methods.md", 4, 5),
        ("docs/methods.md", 2, 2),
        ("docs/methods.md", 3, 3),
    ]
    assert cited_sections("(docs/study.md §9)")[0][1:] == ("docs/study.md", 9, 9)
    assert not cited_sections("Lin et al. (2024) §3.4: the guided std")  # a paper's section
    assert methods_sections() >= {1, 2, 3, 4, 5, 6} and not sections("docs/nowhere.md")
    files = {"docs/methods.md", "bench/RESULTS.md", "README.md"}
    text = "docs/methods.md, bench/RESULTS.md, docs/gone.md, eval/report.md, see [a](a.md)"
    assert uncommitted_md_paths(text, files) == ["docs/gone.md"]


def help_screens() -> dict[str, str]:
    """Every stage's and command's --help and --fields, as a user sees them."""
    from pipeline.cli import describe, names
    from pipeline.usage import help_text
    from stages.presets import DEFAULT

    screens = {}
    for name in names():
        screens[f"{name} --help"] = help_text(name, DEFAULT)
        screens[f"{name} --fields"] = describe(name, DEFAULT, [], print_config=False)
    return screens


def test_code_help_and_docs_cite_only_what_the_repository_holds():
    """No code, help screen or doc cites a design paper that is not in the repository or a path
    to a .md file that is not committed, and every `docs/<page>.md §N` (a bare `§N` in code:
    docs/methods.md's) names a section that page has."""
    files = committed()
    texts = {
        path: (REPO / path).read_text()
        for path in sorted(files)
        if path.endswith((".py", ".md", ".toml")) or path == "Makefile"
    }
    texts.pop("tests/test_docs.py")  # the patterns themselves
    texts |= help_screens()
    foreign, paths, missing = [], [], []
    for where, text in texts.items():
        foreign += [f"{where}: {m.group(0)}" for m in FOREIGN.finditer(text)]
        paths += [f"{where}: {p}" for p in uncommitted_md_paths(text, files)]
        bare_ok = not where.endswith(".md")  # in a doc, a bare § follows its page's link
        for said, doc, first, last in cited_sections(text):
            if not bare_ok and not said.startswith("docs/"):
                continue
            if not set(range(first, last + 1)) <= sections(doc):
                missing.append(f"{where}: {said} ({doc})")
    assert not foreign, f"citations of files not in the repository: {foreign}"
    assert not paths, f"paths to .md files that are not committed: {paths}"
    assert not missing, f"sections the cited docs do not have: {missing}"


def test_make_help_shows_no_unexpanded_variable():
    if shutil.which("make") is None:
        pytest.skip("no make")
    out = subprocess.run(
        ["make", "-s", "-f", str(REPO / "Makefile"), "help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "make prepare" in out.stdout, out.stderr
    assert "$(" not in out.stdout, out.stdout


# ---------------------------------------------------------------- make clean


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the Makefile in a project folder of its own (clean acts next to its Makefile),
    with runs/ inside and a runs folder outside it."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    root = tmp_path / "project"
    (root / "runs" / "digits").mkdir(parents=True)
    (root / "runs" / "digits" / "manifest.json").write_text("{}")
    (root / ".venv").mkdir()
    (root / "src").mkdir()
    (root / "src" / "code.py").write_text("x = 1\n")
    shutil.copy(REPO / "Makefile", root / "Makefile")
    (tmp_path / "elsewhere" / "runs").mkdir(parents=True)
    return root


def clean(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "clean", *args], cwd=root, capture_output=True, text=True, timeout=60
    )


def test_make_clean_removes_runs_and_refuses_a_folder_outside_unless_forced(project):
    outside = project.parent / "elsewhere" / "runs"
    refused = clean(project, f"OUT={outside}")
    assert refused.returncode != 0 and outside.is_dir()
    assert "outside this checkout" in refused.stderr and "FORCE=1" in refused.stderr
    assert clean(project, "OUT=../elsewhere/runs").returncode != 0 and outside.is_dir()
    done = clean(project, f"OUT={outside}", "FORCE=1")
    assert done.returncode == 0 and not outside.exists(), done.stderr
    done = clean(project)  # OUT defaults to runs
    assert done.returncode == 0 and not (project / "runs").exists(), done.stderr
    assert clean(project).returncode == 0  # nothing left to remove: fine
    assert sorted(p.name for p in project.iterdir()) == [".venv", "Makefile", "src"]


def test_make_clean_never_removes_the_checkout_git_the_venv_or_committed_files(project):
    if shutil.which("git") is None:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q", "."], cwd=project, check=True)
    subprocess.run(["git", "add", "src/code.py", "Makefile"], cwd=project, check=True)
    before = sorted(str(p.relative_to(project)) for p in project.rglob("*"))
    for out in (".", "..", "/", str(project), ".git", ".venv", "src", "Makefile", ""):
        for force in ([], ["FORCE=1"]):
            result = clean(project, f"OUT={out}", *force)
            assert result.returncode != 0, (out, force, result.stdout)
            assert result.stderr.startswith("semix clean: ") and "nothing removed" in result.stderr
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*")) == before


def test_setup_on_a_full_disk_stops_before_pip_with_one_line_naming_the_fix(project):
    """A new .venv needs ~6.5 GB; with less free the setup ends in one line (the folder, the
    fix) before anything is created. VENV_GB stands in for a full disk."""
    venv = project / "venv-new"
    for name in ("requirements.txt", "pyproject.toml"):
        shutil.copy(REPO / name, project / name)
    result = subprocess.run(
        ["make", "-s", "setup", f"VENV={venv}", "VENV_GB=1000000"],
        cwd=project, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and not venv.exists()
    lines = [line for line in result.stderr.splitlines() if line.startswith("semix setup:")]
    assert len(lines) == 1, result.stderr
    assert f"free on the disk of {project}" in lines[0] and "VENV=" in lines[0]


# ---------------------------------------------------------------- documented commands

LAUNCH = re.compile(r"(?:^|\s)(?:\S*/)?semix\s+|(?:^|\s)-m\s+pipeline\s+")
PLACEHOLDER = re.compile(r"[<>…]|\.\.\.|^\$|^X\.")
SHELL_OPS = {"&&", "||", "|", ";", ">", "2>&1", "&"}


def command_lines(code: str) -> list[str]:
    """Shell lines of a code block or span: continuations joined, prompts and comments gone."""
    lines = []
    code = re.sub(r"^```.*$", "", code, flags=re.M)  # the fences of a block
    for line in code.replace("\\\n", " ").splitlines():
        line = re.sub(r"^\$\s+", "", line.strip())
        line = " ".join(re.split(r"\s+#", line)[0].split())
        if line:
            lines.append(line)
    return lines


def semix_args(line: str, names: set[str]) -> list[str] | None:
    """The arguments `semix` gets from a documented line (`semix ...`, `python -m pipeline
    ...`, `accelerate launch ... -m pipeline ...`), or None if the line runs no semix command."""
    found = LAUNCH.search(line)
    if found is None:
        return None
    try:
        args = shlex.split(line[found.end() :])
    except ValueError:
        return None
    for i, arg in enumerate(args):
        if arg in SHELL_OPS:
            args = args[:i]
            break
    if not args or args[0] not in names:
        return None  # prose ("semix does ..."), or a printed message ("semix train: error: ...")
    return args


def make_semix_args(line: str, targets: set[str]) -> list[str] | None:
    """What `make <target> VAR=...` runs as semix, read from `make -n` (Makefile variables
    mapped to --set exactly as the user gets them)."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    if len(words) < 2 or words[0] != "make" or words[1] not in targets:
        return None
    words = [w for w in words[1:] if not w.startswith(("-", "["))]  # `[RUN=name]`: optional
    words = words[: next((i for i, w in enumerate(words) if w in SHELL_OPS), len(words))]
    dry = subprocess.run(
        ["make", "-n", "-s", "-f", str(REPO / "Makefile"), *words],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, f"`{line}`: make -n fails: {dry.stderr.strip()}"
    runs = [x for x in dry.stdout.splitlines() if " -m pipeline " in x]
    return shlex.split(runs[-1].split(" -m pipeline ", 1)[1]) if runs else None


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, line, semix arguments) of every semix command the docs show as code."""
    from pipeline.cli import COMMANDS, STAGES

    names = {*STAGES, *COMMANDS}
    targets = makefile_targets(REPO / "Makefile")
    found: dict[tuple[str, str], list[str]] = {}
    for doc in DOCS:
        for code in code_of(doc.read_text()):
            for line in command_lines(code):
                if PLACEHOLDER.search(line):
                    continue  # `--preset <preset> …`: a shape, not a command
                args = semix_args(line, names)
                if args is None and shutil.which("make") and line.startswith("make "):
                    args = make_semix_args(line, targets)
                if args is not None:
                    found[(str(doc.relative_to(REPO)), line)] = args
    return [(doc, line, args) for (doc, line), args in found.items()]


def test_the_command_finder_sees_what_it_checks():
    from pipeline.cli import COMMANDS, STAGES

    names = {*STAGES, *COMMANDS}
    assert command_lines("```bash\n$ semix train \\\n  --set run=a  # why\n```") == [
        "semix train --set run=a"
    ]
    assert semix_args(
        "accelerate launch --num_processes 2 -m pipeline train --set run=d", names
    ) == [
        "train",
        "--set",
        "run=d",
    ]
    assert semix_args(".venv/bin/semix evaluate --set run=ce && ls", names) == [
        "evaluate",
        "--set",
        "run=ce",
    ]
    assert semix_args("semix annotate: error: no series", names) is None
    assert semix_args("semix does not copy.", names) is None
    from pipeline.cli import main

    assert main(["train", "--set", "losss=ce", "--print-config"]) != 0  # what the check catches
    if shutil.which("make"):
        assert make_semix_args(
            "make train RUN=csm LOSS=csm", makefile_targets(REPO / "Makefile")
        ) == [
            "train",
            "--preset",
            "digits",
            "--set",
            "out=runs",
            "run=csm",
            "loss=csm",
        ]


def test_every_documented_command_parses_and_resolves_its_config(capsys, tmp_path, monkeypatch):
    """Each semix command the README and docs show (directly, under a launcher, or through a make
    target) is run with --print-config: the command, the preset and every --set key must be ones
    semix accepts. Shapes with placeholders (`<preset>`, `…`) are skipped; a tracker package that
    is not installed here may give its own one-line error. The commands run in a copy of the
    checkout's top level without its runs root: what `make generate` left there (a finished
    chain made with other values) must not decide whether a documented command resolves."""
    from pipeline.cli import main

    for entry in REPO.iterdir():
        if entry.name not in ("runs", ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)

    commands = documented_commands()
    assert len(commands) >= 40, f"only {len(commands)} documented commands found: the finder broke"
    bad = []
    # an argv the docs show in several places is resolved once: --print-config starts no work,
    # so the same argv in the same folder resolves the same way
    seen: dict[tuple[str, ...], tuple[int, str, str]] = {}
    for doc, line, args in commands:
        key = tuple(args)
        if key not in seen:
            code = main([*args, "--print-config"])
            seen[key] = (code, *capsys.readouterr())
        code, out, err = seen[key]
        if code == 0 and "--fields" in args:
            assert out.startswith(f"semix {args[0]} "), line  # the field table
        elif code == 0:
            assert isinstance(json.loads(out), dict), line  # the resolved config, nothing else
        elif "not installed here: pip install" not in err:  # an optional tracker
            bad.append(f"{doc}: `{line}` -> exit {code}: {err.strip().splitlines()[-1:]}")
    assert not bad, "documented commands semix rejects:\n" + "\n".join(bad)
