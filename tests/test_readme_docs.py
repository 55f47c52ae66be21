"""What the README, docs/ and samples/ show a newcomer: files that exist in the repository,
examples that run as printed, and no term left unexplained."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO, SAMPLES
from tui.cli import main

#: The documents a reader of the repository sees.
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.txt")),
        *sorted((REPO / "docs").rglob("*.md")), *sorted(SAMPLES.glob("*.md")),
        *sorted(SAMPLES.glob("*.py")), *sorted((SAMPLES / "presets").glob("*.toml"))]

#: A path of the repository's own folders, as the documents name them.
_REPO_PATH = re.compile(r"(?<![\w./-])((?:samples|tests|docs|benchmarks|hooks|tui|minillm)/"
                        r"[\w./-]*\w\.(?:py|txt|toml|md|sqlite))")


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_documents_refer_only_to_files_in_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    assert "../" not in text, f"{doc.name} refers to a file outside the repository"
    assert "/work/" not in text and "shared/cases" not in text
    for path in _REPO_PATH.findall(text):
        assert (REPO / path).exists(), f"{doc.name} names {path}, which is not in the repository"


def test_the_step_into_example_of_the_readme_runs_from_the_repository(capsys, monkeypatch,
                                                                      tmp_path):
    """The README's step-into screen comes from ``samples/user_gpt.py``: the command it names
    runs from the repository root, and the op and line it shows are the ones mdb finds."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"first op creating non-finite values: #16 (\w+) at (user_gpt\.py:\d+)",
                      readme)
    assert shown is not None
    assert "`mdb step --model\nsamples/user_gpt.py:nanogpt_nan`" in readme
    monkeypatch.chdir(REPO)
    assert main(["capture", "--model", "samples/user_gpt.py:nanogpt_nan", "--out",
                 str(tmp_path / "t.mdbtrace")]) == 0
    text = capsys.readouterr().out
    assert f"first non-finite: {shown[1]} at {shown[2]}" in text


def test_the_readme_explains_its_terms():
    """ "seed 000", "test B/C" and the seed's "next steps" are names from the tutorial minillm
    was written from; the README uses them only where it says so."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    terms = [re.compile(r"\b[Ss]eed 000\b"), re.compile(r"\btest [ABC]\b"),
             re.compile(r"\b(?:fourth|fifth) next step"), re.compile(r"\b[Ss]eed test\b")]
    for term in terms:
        for paragraph in _paragraphs(readme):
            if term.search(paragraph):
                assert "tutorial" in paragraph, f"{term.pattern} unexplained: {paragraph[:200]}"
    samples_readme = (SAMPLES / "README.md").read_text(encoding="utf-8")
    assert not terms[0].search(samples_readme)


def test_mdb_ablate_help_says_what_it_does_without_the_tutorials_names(capsys):
    with pytest.raises(SystemExit) as done:
        main(["ablate", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "a controlled-variable experiment in one command" in out
    assert "seed 000" not in out.lower()
