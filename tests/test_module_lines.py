"""The 500-line rule: every module of ``longstraw_core/``, ``model_adapters/`` and ``recipes/``
has at most 500 lines, so that each reads as one job; a module that grows past it is split by
responsibility (``docs/development.md``). The few that stay one are listed, each with why."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500
PACKAGES = ("longstraw_core", "model_adapters", "recipes")

# Modules allowed past MAX_LINES, each with the one-line reason it stays one module.
EXCEPTIONS = {
    "longstraw_core/config/validation.py": "one job, the rules over the config's own values, "
    "one function per section in the order validate runs them",
}


def _lines() -> dict[str, int]:
    """Every module of ``PACKAGES``, by path from the repository root: its number of lines."""
    return {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_every_module_has_at_most_500_lines_but_the_listed_exceptions() -> None:
    lines = _lines()
    assert len(lines) > 100  # the packages were found
    over = {path: n for path, n in lines.items() if n > MAX_LINES and path not in EXCEPTIONS}
    assert over == {}, (
        f"over {MAX_LINES} lines: {over}; split each by responsibility, or list it in "
        "EXCEPTIONS with why it stays one"
    )


def test_every_listed_exception_is_a_module_still_over_the_limit() -> None:
    """An exception that no longer needs to be one leaves the list (or it would hide growth)."""
    lines = _lines()
    stale = [path for path in EXCEPTIONS if lines.get(path, 0) <= MAX_LINES]
    assert stale == [], f"no longer over {MAX_LINES} lines (or gone): remove from EXCEPTIONS"
