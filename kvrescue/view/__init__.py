"""`kvrescue view`: one self-contained HTML file to explore run folders.

It holds the report's tables and plot (from `kvrescue.report`, the same code as `kvrescue report`), a
problem list across every run with filters and search, and a page per problem: the committed trajectory
step by step (base or helper, scores, every candidate with its finish reason and detector extremes), side
by side with the same problem under the other runs, aligned by step. `data` builds what the page holds,
`page` packs it into the HTML template (page.html, page.css, page.js beside this file) with KaTeX (katex/,
vendored by scripts/vendor_katex.sh), which draws the maths of problems, steps and candidates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from kvrescue import report as rep
from kvrescue.files import write_file_atomic
from kvrescue.report.seeds import DEFAULT_KS
from kvrescue.view.data import detail_chunks, page_data
from kvrescue.view.page import render


def write_view(paths: Iterable[Path | str], out: Path, candidate_texts: bool = True,
               ks: Sequence[int] = DEFAULT_KS) -> tuple[list[rep.Run], list[rep.FolderNote]]:
    """Read the run folders under `paths` and write the page to `out` atomically (without the texts of
    candidates that were not committed unless `candidate_texts`: they are most of a page's size); `ks`: the k of
    the report's pass@k and maj@k.

    Returns the runs shown and the notes on folders (unusable folders, runs in progress), as `report.load_runs`.
    """
    runs, notes = rep.load_runs(paths)
    html = render(page_data(runs, notes, candidate_texts, ks), [detail_chunks(run, candidate_texts) for run in runs],
                  title=f"kvrescue runs ({len(runs)} run{'s' * (len(runs) != 1)})")
    write_file_atomic(out, html.encode("utf-8"))
    return runs, notes
