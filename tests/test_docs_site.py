"""The docs site (mkdocs.yml over docs/) builds in strict mode: a broken link or anchor, or a
page left out of the nav, fails the suite. `make docs` runs the same build."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _need_mkdocs() -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material",
                        reason="mkdocs-material is not installed: pip install -e '.[docs]'")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # NO_MKDOCS_2_WARNING: material prints an end-of-life banner on every build otherwise.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, env=env, timeout=300, check=False)


def test_the_docs_build_in_strict_mode(tmp_path):
    _need_mkdocs()
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    for page in (ROOT / "docs").glob("*.md"):
        built = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (tmp_path / "site" / built).is_file(), f"{page.name} was not built"


def test_an_orphan_page_or_a_broken_link_fails_the_build(tmp_path):
    _need_mkdocs()
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    docs = shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (docs / "orphan.md").write_text("# Not in the nav\n", encoding="utf-8")
    page = docs / "speed.md"
    page.write_text(page.read_text(encoding="utf-8")
                    + "\n[gone](no-such-page.md), [moved](training.md#no-such-anchor)\n",
                    encoding="utf-8")
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    # Each one is a WARNING (mkdocs only INFOs an orphan page or a bad anchor by default), so
    # each alone aborts a strict build.
    warnings = _records(result.stderr, "WARNING")
    for reported in ("orphan.md", "no-such-page.md", "#no-such-anchor"):
        assert any(reported in record for record in warnings), result.stderr


def _records(log: str, level: str) -> list[str]:
    """mkdocs' log messages of one level; a message's indented lines belong to it."""
    records: list[str] = []
    for line in log.splitlines():
        if line.startswith(" ") and records:
            records[-1] += "\n" + line
        else:
            records.append(line)
    return [r for r in records if r.startswith(level)]


def test_the_readme_links_only_to_files_that_exist():
    # The README is not part of the site (GitHub renders it), so mkdocs does not check it.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)[^)]*\)", readme)
    assert "docs/configuration.md" in targets
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
