"""conftest.ENGINE_FILES names real test files, and every test file that asks for the session's vLLM is named
there: a file missing from it would start a second engine on another xdist worker."""

from __future__ import annotations

import re
from pathlib import Path

from support.paths import ENGINE_FILES, ROOT, TESTS


def test_engine_files_exist_and_cover_every_user_of_the_session_engine():
    assert sorted(r for r in ENGINE_FILES if not (TESTS / r).is_file()) == []
    users = {p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py")
             if p != Path(__file__) and re.search(r"\b(vllm_engine|engine_url|vllm_session)\b", p.read_text())}
    assert users and users <= ENGINE_FILES, sorted(users - ENGINE_FILES)


def test_the_readme_test_command_schedules_by_group():
    """The groups above take effect only under `--dist loadgroup` (xdist's other modes ignore xdist_group)."""
    test_cmd = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[1]
    assert " -n 2 --dist loadgroup" in test_cmd
