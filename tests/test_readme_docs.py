"""What the README, docs/ and samples/ show a newcomer: files that exist in the repository,
examples that run as printed, and no term left unexplained."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex

import pytest

from tests.conftest import REPO, SAMPLES
from tui.cli import build_parser, main

#: The documents a reader of the repository sees.
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.txt")),
        *sorted((REPO / "docs").rglob("*.md")), *sorted(SAMPLES.glob("*.md")),
        *sorted(SAMPLES.glob("*.py")), *sorted((SAMPLES / "presets").glob("*.toml"))]

#: A path of the repository's own folders, as the documents name them.
_REPO_PATH = re.compile(r"(?<![\w./-])((?:samples|tests|docs|benchmarks|hooks|tui|minillm)/"
                        r"[\w./-]*\w\.(?:py|txt|toml|md|sqlite))")


#: The guides in docs/ the README links to (issue 21: the README ≤ 400 lines, the rest there).
GUIDES = ["own-loop", "loop-doctor", "torchrun", "doctor", "compare", "models", "runs",
          "step-view", "measured", "gaps", "what-if", "serve", "spikes",
          "memory"]

#: The README and its guides.
MARKDOWN = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_documents_refer_only_to_files_in_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    assert "../" not in text, f"{doc.name} refers to a file outside the repository"
    assert "/work/" not in text and "shared/cases" not in text
    for path in _REPO_PATH.findall(text):
        assert (REPO / path).exists(), f"{doc.name} names {path}, which is not in the repository"


def test_the_step_into_example_of_the_step_view_guide_runs_from_the_repository(
        capsys, monkeypatch, tmp_path):
    """The step-into screen of docs/step-view.md comes from ``samples/user_gpt.py``: the command
    it names runs from the repository root, and the op and line it shows are the ones mdb
    finds."""
    guide = (REPO / "docs" / "step-view.md").read_text(encoding="utf-8")
    shown = re.search(r"first op creating non-finite values: #16 (\w+) at (user_gpt\.py:\d+)",
                      guide)
    assert shown is not None
    assert "`mdb step --model\nsamples/user_gpt.py:nanogpt_nan`" in guide
    monkeypatch.chdir(REPO)
    assert main(["capture", "--model", "samples/user_gpt.py:nanogpt_nan", "--out",
                 str(tmp_path / "t.mdbtrace")]) == 0
    text = capsys.readouterr().out
    assert f"first non-finite: {shown[1]} at {shown[2]}" in text


def test_the_readme_explains_its_terms():
    """ "seed 000", "test B/C" and the seed's "next steps" are names from the tutorial minillm
    was written from; the README and its guides use them only where they say so."""
    terms = [re.compile(r"\b[Ss]eed 000\b"), re.compile(r"\btest [ABC]\b"),
             re.compile(r"\b(?:fourth|fifth) next step"), re.compile(r"\b[Ss]eed test\b")]
    for doc in MARKDOWN:
        for paragraph in _paragraphs(doc.read_text(encoding="utf-8")):
            for term in terms:
                if term.search(paragraph):
                    assert "tutorial" in paragraph, (
                        f"{doc.name}: {term.pattern} unexplained: {paragraph[:200]}")
    samples_readme = (SAMPLES / "README.md").read_text(encoding="utf-8")
    assert not terms[0].search(samples_readme)


def test_mdb_ablate_help_says_what_it_does_without_the_tutorials_names(capsys):
    with pytest.raises(SystemExit) as done:
        main(["ablate", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a controlled-variable experiment in one command" in out
    assert "seed 000" not in out.lower()


def _blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``lang`` in a Markdown text."""
    return re.findall(rf"^```{lang}\n(.*?)\n```", text, re.S | re.M)


def _command_lines(text: str) -> list[str]:
    """The command lines of the ``bash`` blocks: comments and redirections cut off."""
    lines = []
    for block in _blocks(text, "bash"):
        for line in block.splitlines():
            line = re.sub(r"(^|\s+)#.*$", "", line).split(" > ", 1)[0]
            lines += [part.strip() for part in line.split(" && ") if part.strip()]
    return lines


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_the_readme_is_short_and_links_every_guide():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= 400
    for name in GUIDES:
        assert f"](docs/{name}.md)" in readme, f"the README does not link docs/{name}.md"
    assert sorted(p.stem for p in (REPO / "docs").glob("*.md")) == sorted(GUIDES)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_links_of_the_readme_and_the_guides_lead_somewhere(doc):
    text = doc.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
        assert not target.startswith(("http:", "https:")), f"{doc.name}: a link out: {target}"
        linked = (doc.parent / target) if target else doc
        assert linked.exists(), f"{doc.name} links {target}, which is not there"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc.name}: no heading #{anchor}"


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_python_examples_compile(doc):
    """Every ``python`` block compiles as printed (the complete samples of docs/own-loop.md and
    docs/torchrun.md are also compared with samples/ and run by tests of their own)."""
    for i, block in enumerate(_blocks(doc.read_text(encoding="utf-8"), "python"), 1):
        compile(block, f"{doc.name}, python block {i}", "exec")


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_command_lines_of_the_examples_are_mdb_s_own(doc):
    """Every ``mdb`` line of a ``bash`` block parses with mdb's own parser (each subcommand,
    option and value exists; nothing runs); the other lines are python, pytest or torchrun,
    and the scripts they name exist."""
    parser = build_parser()
    lines = _command_lines(doc.read_text(encoding="utf-8"))
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] in {"mdb", "python", "torchrun"}, f"{doc.name}: {line}"
        for word in argv:
            if word.endswith(".py"):
                assert (REPO / word).exists(), f"{doc.name}: {line}: no {word}"
        if argv[0] != "mdb":
            continue
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{doc.name}: {line}: {err.getvalue().strip()}")
        assert args.command == argv[1]
        argv = _unserved(argv)
        known = _subcommands()[argv[1]]._option_string_actions  # whole names, no abbreviation
        for word in argv[2:]:
            if word.startswith("--"):
                assert word.split("=", 1)[0] in known, f"{doc.name}: {line}: no {word}"


def _unserved(words: list[str]) -> list[str]:
    """``mdb serve [--port P] [--host H] [--public-url U] COMMAND ARGS…`` read as the command
    it serves (``mdb COMMAND ARGS…``), whose options are then checked; other lines as they are."""
    if len(words) < 3 or words[1] != "serve":
        return words
    rest = words[2:]
    while rest and rest[0] in ("--port", "--host", "--public-url"):
        rest = rest[2:]
    if not rest or rest[0].startswith("-") or rest[0] == "COMMAND":  # the placeholder
        return words
    return ["mdb", *rest]


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_the_mdb_commands_named_in_the_text_exist(doc):
    """An ``mdb SUBCOMMAND --option`` quoted in the text (not a whole command line: ``mdb stop
    RUN``, ``mdb overfit --nproc N``) names a subcommand and options mdb has."""
    subcommands = _subcommands()
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    spans = re.findall(r"`(mdb [^`]*)`", text)
    for span in spans:
        words = span.split()
        if words[1].startswith("-"):
            assert words[1] in {"--help", "--version"}, span
            continue
        assert words[1] in subcommands, f"{doc.name}: `{span}`: no subcommand {words[1]}"
        words = _unserved(words)
        assert words[1] in subcommands, f"{doc.name}: `{span}`: no subcommand {words[1]}"
        if words[1] == "serve":
            continue
        known = subcommands[words[1]]._option_string_actions
        for word in words[2:]:
            option = word.strip("[]").split("=", 1)[0]
            if option.startswith("-"):
                assert option in known, f"{doc.name}: `{span}`: mdb {words[1]} has no {option}"


def test_the_benchmark_commands_of_the_measured_figures_exist():
    """Each ``python benchmarks/…`` command of docs/measured.md names a script there, and each
    option it passes is one the script declares."""
    text = (REPO / "docs" / "measured.md").read_text(encoding="utf-8")
    commands = re.findall(r"`((?:python|pytest) [^`]+)`", text)
    assert len(commands) >= 8
    for command in commands:
        words = shlex.split(command)
        script = next(w for w in words if w.endswith(".py"))
        assert (REPO / script).exists(), command
        if words[0] == "python":
            source = (REPO / script).read_text(encoding="utf-8")
            for word in words:
                if word.startswith("--"):
                    assert f'"{word}"' in source, f"{command}: {script} declares no {word}"


def test_the_precision_example_of_the_what_if_guide_prints_what_it_shows(capsys):
    """Issue 35: the example set no seed, so its losses did not reproduce. It runs here as
    printed; the lines it shows are its output, the losses to fp16's tolerance (another CPU's
    kernels may round the last digits differently)."""
    guide = (REPO / "docs" / "what-if.md").read_text(encoding="utf-8")
    part = guide[guide.index("## Precision diff"):]
    code = re.search(r"```python\n(.*?)```", part, re.S).group(1)
    shown = re.search(r"prints\n\n```text\n(.*?)```", part, re.S).group(1).splitlines()
    assert "torch.manual_seed(" in code
    exec(compile(code, "what-if.md", "exec"), {"__name__": "what_if_example"})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(shown)
    number = re.compile(r"\d+\.\d+")
    for got, want in zip(printed, shown, strict=True):
        assert number.sub("#", got) == number.sub("#", want)
        if got.startswith("loss:"):
            assert [float(x) for x in number.findall(got)] == pytest.approx(
                [float(x) for x in number.findall(want)], rel=2e-3)


@pytest.mark.parametrize("doc", ["docs/screens/live.txt", "docs/runs.md"])
def test_the_live_screen_shown_in_the_docs_is_todays(doc):
    """Issue 35: the docs showed an old live screen (its title, ``c capture a step``,
    ``s step``). Its footer is the watch screen's own keys (from its bindings, the ones the
    footer shows while a run trains), its title the watch screen's."""
    from tui.screens.live_watch import WatchScreen

    text = (REPO / doc).read_text(encoding="utf-8")
    screen = text[text.index(" mdb watch · run "):] if doc.endswith(".md") else text
    lines = screen.splitlines()
    assert lines[0].startswith(" mdb watch · run ")
    footer = next(line for line in lines if line.startswith(" p pause/resume"))
    shown = [b for b in WatchScreen.BINDINGS if b.show and b.action != "step"]
    want = "  ".join(f"{b.key_display or b.key.split(',')[0]} {b.description}" for b in shown)
    assert footer.strip() == want
    assert "capture a step" not in text and " s step " not in footer
