"""The docs site builds with strict checking, the README stays a front page whose links all
resolve, and the generated command-line page says what the parser says now.

Strict means a broken link, a missing anchor, or an API reference to a flow or module that
moved fails the build (mkdocs.yml's ``validation``), so the docs cannot silently drift from
the code.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 250

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    flows = (site / "reference" / "api" / "flows" / "index.html").read_text()
    assert 'id="flows.align.psi_align_party"' in flows, "mkdocstrings rendered no flow"
    assert (site / "reference" / "job-file" / "index.html").exists()


def test_the_readme_is_a_front_page() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to docs/"
    )
    for command in ("make demo", "make test"):
        assert any(line.startswith(command) for line in lines), f"README lost `{command}`"
    assert "\n## Layout\n" in text


def test_every_relative_link_in_the_readme_resolves() -> None:
    text = README.read_text()
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        page = (ROOT / path) if path else README
        if not page.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and page.suffix == ".md" and anchor not in _anchors(page):
            broken.append(f"{target}: {path or 'README.md'} has no heading #{anchor}")
    assert not broken, "README links that do not resolve:\n" + "\n".join(broken)


def _anchors(page: Path) -> set[str]:
    """The anchors the docs' headings get (MkDocs' toc slugs, which GitHub's match here)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := _HEADING.match(line)):
            anchors.add(slugify(match.group(1).replace("`", ""), "-"))
    return anchors


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs/cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.PAGE.read_text() == module.markdown(), (
        "docs/reference/cli.md is stale: regenerate with python docs/cli_reference.py"
    )
