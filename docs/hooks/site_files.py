"""MkDocs hook: the site's generated and borrowed pages, and links into the repository.

* ``reference/configuration.md`` is generated from the schema's source at every build
  (``ragen_jax.config.reference``), so the reference cannot drift from the code.
* ``experiments/results/*`` (the raw result tables and their figures) become site pages at
  the same paths, so the results page links them and the build checks those links.
* A page's relative link that leaves ``docs/`` (written so that it also works on GitHub, e.g.
  ``../experiments/results/bench_envs.md``) is rewritten to the borrowed page's address; one
  that points at nothing in the site is a warning, which ``--strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
BORROWED = ("experiments/results",)  # repository folders published as they are
REFERENCE = "reference/configuration.md"
LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
log = logging.getLogger("mkdocs.hooks.site_files")


def on_files(files: Files, config) -> Files:
    """Adds the generated configuration reference and the borrowed result files."""
    import sys

    sys.path.insert(0, str(ROOT))  # the worktree's ragen_jax, not an installed copy
    from ragen_jax.config.reference import reference_markdown

    files.append(File.generated(config, REFERENCE, content=reference_markdown()))
    for folder in BORROWED:
        for path in sorted((ROOT / folder).iterdir()):
            if path.suffix in (".md", ".png") and path.is_file():
                files.append(File(f"{folder}/{path.name}", src_dir=str(ROOT),
                                  dest_dir=config["site_dir"],
                                  use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrites links that leave ``docs/`` to the site's copy of their target."""
    if page.file.abs_src_path is None:  # generated: its links are written for the site
        return markdown
    here = Path(page.file.abs_src_path).parent
    by_source = {Path(f.abs_src_path).resolve(): f for f in files if f.abs_src_path}

    def fix(match: re.Match) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        real = (here / target).resolve()
        found = by_source.get(real)
        if found is None and real.is_relative_to(Path(config["docs_dir"]).resolve()):
            return match.group(0)  # a missing page: MkDocs' own check reports it
        if found is None:
            log.warning("%s: link %r points at %s, which is not part of the site",
                        page.file.src_uri, target, real)
            return match.group(0)
        rel = os.path.relpath(found.src_uri, os.path.dirname(page.file.src_uri) or ".")
        return f"{match.group(1)}{rel}{match.group(3)}"

    return LINK.sub(fix, markdown)
