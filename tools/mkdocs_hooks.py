"""MkDocs hooks (mkdocs.yml `hooks:`): a page's links to repository files outside docs/ (a figure under
results/, a source file, an example) work in the built site as they do on GitHub.

`on_files` adds each such file to the site under `_repo/<its path>`; `on_page_markdown` points the link there. Only
files that exist and are not Markdown are added: a link to a missing file, or to a Markdown file outside docs/, is
left as written, so `mkdocs build --strict` reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?\)")  # [text](target#anchor) and ![alt](target)
REPO = "_repo"  # where in the site the repository's files go


def _outside(page_uri: str, target: str, docs: Path) -> str | None:
    """The repository path (posix) of a link `target` on the page `page_uri` when it names an existing non-Markdown
    file outside docs/ in the repository; None for anything else (URLs, pages, missing files)."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = ((docs / page_uri).parent / target).resolve()
    root = docs.parent
    if path.is_relative_to(docs) or not path.is_relative_to(root) or not path.is_file() or path.suffix == ".md":
        return None
    return path.relative_to(root).as_posix()


def on_files(files: Files, config) -> Files:
    docs = Path(config.docs_dir).resolve()
    for page in list(files.documentation_pages()):
        for _, target, _ in LINK.findall(Path(page.abs_src_path).read_text(encoding="utf-8")):
            rel = _outside(page.src_uri, target, docs)
            if rel is not None and files.get_file_from_path(f"{REPO}/{rel}") is None:
                files.append(File.generated(config, f"{REPO}/{rel}", abs_src_path=str(docs.parent / rel),
                                            inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    docs = Path(config.docs_dir).resolve()

    def point(m: re.Match) -> str:
        rel = _outside(page.file.src_uri, m.group(2), docs)
        if rel is None:
            return m.group(0)
        new = posixpath.relpath(f"{REPO}/{rel}", posixpath.dirname(page.file.src_uri) or ".")
        return f"{m.group(1)}{new}{m.group(3) or ''})"

    return LINK.sub(point, markdown)
