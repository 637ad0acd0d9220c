"""docs/RESULTS.md: every measured figure names the file that backs it.

The rule, checked here without running anything:

- the document is split at its ``## `` headings; each section (one measurement: its figures, the command that
  measured them and where the raw output lies) cites at least one *backing file*: a path under ``results/`` (the
  product's benches) or an experiment's ``experiments/NAME/results/`` (a folder cited with a trailing ``/`` counts);
- every backing path cited anywhere in the document exists in the repository (a file, or a non-empty folder);
- the text before the first ``## `` heading carries no figures of its own (only the rule).

A figure whose raw output is not committed has no place in docs/RESULTS.md: commit the output, or drop the
figure (README.md's "First run" says what a user's own run prints, which the user's run itself backs).
"""

from __future__ import annotations

import re

from support.paths import ROOT

DOC = ROOT / "docs" / "RESULTS.md"
# A backing path, up to a quote, space, bracket or comma: experiments/NAME/results/..., or results/X/... or
# results/X.ext (a word of its own: "results/s" is a rate, not a path).
BACKING = re.compile(r"(experiments/[a-z0-9_]+/results/(?:[A-Za-z0-9_.*/-]*[A-Za-z0-9_/*])?"
                     r"|(?<!\w)results/[A-Za-z0-9_*-]+[/.](?:[A-Za-z0-9_.*/-]*[A-Za-z0-9_/*])?)")


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) per ``## `` section of ``text``; the part before the first heading as heading ``""``."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    out = [("", parts[0])]
    out += [(parts[i].strip(), parts[i + 1]) for i in range(1, len(parts), 2)]
    return out


def _exists(rel: str) -> bool:
    if "*" in rel:
        return any(ROOT.glob(rel))
    p = ROOT / rel.rstrip("/")
    return p.is_file() or (p.is_dir() and any(p.iterdir()))


def test_every_results_section_cites_a_backing_file():
    secs = sections(DOC.read_text(encoding="utf-8"))
    assert len(secs) > 5, "docs/RESULTS.md lost its sections"
    uncited = [h for h, body in secs[1:] if not BACKING.search(body)]
    assert not uncited, f"sections without a file under results/ or experiments/NAME/results/: {uncited}"


def test_every_cited_backing_path_exists():
    text = DOC.read_text(encoding="utf-8")
    missing = sorted({m for m in BACKING.findall(text) if not _exists(m)})
    assert not missing, f"docs/RESULTS.md cites files that are not in the repository: {missing}"


def test_the_preamble_holds_no_figures():
    head = sections(DOC.read_text(encoding="utf-8"))[0][1]
    figures = re.findall(r"\d+(?:\.\d+)?\s*(?:%|s\b|ms\b|×|nats|probes/s|tokens/s)", head)
    assert not figures, f"figures before the first section, with no file to back them: {figures}"


def test_the_rule_catches_an_uncited_section(tmp_path):
    """The checks above can fail: a section without a backing path, and a path that does not exist."""
    text = "# R\n\n## cited\n\n`experiments/zo/results/lm_summary.json`: 5.1\n\n## bare\n\n9,754 results/s\n"
    secs = sections(text)
    assert [h for h, b in secs[1:] if not BACKING.search(b)] == ["bare"]
    assert not _exists("results/no-such-run/out.json")
    assert _exists("experiments/zo/results/lm_summary.json")
    assert BACKING.findall("`../results/cpu/fleet.json`, experiments/x2/results/ and 12 results/s") == [
        "results/cpu/fleet.json", "experiments/x2/results/"]
