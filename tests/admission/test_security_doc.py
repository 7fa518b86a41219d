"""docs/security.md names the tests that prove each guard: every name must be a test that exists, and
every file path it gives must hold that test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"


def _defined_tests() -> dict[str, set[str]]:
    """Test function name -> the files (relative to the repository) that define it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        for name in re.findall(r"^(?:async )?def (test_\w+)\(", path.read_text(), flags=re.MULTILINE):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_test_the_threat_model_names_exists_where_it_says() -> None:
    text = DOC.read_text()
    defined = _defined_tests()
    named = re.findall(r"`(?:(tests/[\w/]+\.py))?(?:::)?(test_\w+)`", text)
    assert len(named) >= 20
    missing = [name for _, name in named if name not in defined]
    assert missing == []
    misplaced = [(path, name) for path, name in named if path and path not in defined[name]]
    assert misplaced == []
    for module in re.findall(r"`(tests/[\w/]+\.py)`", text):
        assert (ROOT / module).is_file(), module
