"""The front door: the README is a front page, the docs build without a warning, and the reference
pages say what the code says."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import reference

REPO = Path(__file__).resolve().parents[2]
PROSE = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_the_reference_pages_are_generated_from_the_code():
    stale = [name for name, text in reference.pages().items() if (reference.OUT / name).read_text() != text]
    assert not stale, f"docs/reference/{', '.join(stale)} differ from the code: run python -m tools.reference"


def test_the_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs") or pytest.skip("mkdocs is not installed (pip install -e '.[test]')")
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert r.returncode == 0, r.stdout + r.stderr
    site = tmp_path / "site"
    assert (site / "reference" / "cli" / "index.html").is_file()
    # Every page with a diagram loads the diagrams' library from the site itself: drawn offline.
    drawn = [page for page in site.rglob("*.html") if 'class="mermaid"' in page.read_text()]
    assert len(drawn) >= 3, drawn
    for page in drawn:
        script = re.search(r'<script src="([^"]*javascripts/mermaid\.min\.js)"', page.read_text())
        assert script and (page.parent / script.group(1)).resolve().is_file(), page
    assert (site / "javascripts" / "mermaid.min.js").read_bytes().startswith(b'"use strict";var __esbuild_esm_mermaid')


def test_the_readme_is_a_front_page():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for heading in ("## Install", "## Run", "## Test", "## Documentation"):
        assert heading in text
    ci = (REPO / ".ci" / "run").read_text()
    command = re.search(r"```bash\n(pip install -e '\.\[test\]' && python -m pytest -q)\n```", text).group(1)
    assert command.replace("pip install", "pip install -q") in ci, "CI runs the README's test command"
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text, "the CPU-only install is said"


@pytest.mark.parametrize("path", PROSE, ids=lambda p: str(p.relative_to(REPO)))
def test_prose_speaks_to_users(path):
    text = path.read_text()
    assert not re.search(r"\b[Ii]ssue #?\d+|#\d{1,3}\b(?![\w-])", text), "internal issue numbers"
    assert "../shared" not in text, "a path outside the repository"
    assert not re.search(r"\bcommit [0-9a-f]{7,}\b", text), "commit hashes"


def test_every_doc_page_is_in_the_navigation():
    import yaml
    nav = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for n in node:
                yield from pages(n)
        elif isinstance(node, dict):
            for n in node.values():
                yield from pages(n)
    listed = set(pages(nav))
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk == listed, (sorted(on_disk - listed), sorted(listed - on_disk))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
