"""Shape buckets that never shrink within a run, so each jitted program compiles once.

Every jitted program of a run (the sampler's prefill and decode, the update, the collapse
diagnostics' scoring) compiles once per distinct input shape. The lengths behind those shapes
(a level's prompt, the longest trajectory of a batch, the inputs a diagnostic draws) change
from step to step, so bucketing alone still compiles whenever a batch lands in a bucket the
run has not seen, at any step. A ``HighWater`` keeps, for each place a shape is chosen (a
"site"), the widest bucket the run has used there, and hands out at least that: a site's
shapes then only ever grow, a few times early in a run (its first validation samples many
levels), and never flip back to a narrower program. The padding this adds is masked out
everywhere, so no result depends on it beyond floating-point rounding.

The marks are part of a run's state: a checkpoint holds them, and a resumed run reads them,
so it picks the same shapes as the run it continues.
"""

from __future__ import annotations


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // int(multiple)) * int(multiple)


class HighWater:
    """The widest bucket used so far at each site (``{site: width}``)."""

    def __init__(self, marks: dict[str, int] | None = None):
        self.marks: dict[str, int] = dict(marks or {})

    def fit(self, site: str, width: int) -> int:
        """``width`` (already bucketed by the caller), or the site's mark when that is
        wider; the mark follows."""
        width = max(int(width), self.marks.get(site, 0))
        self.marks[site] = width
        return width


def update_multiple(pad_multiple: int, max_model_len: int) -> int:
    """The update rows' width step: ``actor.row_pad_multiple``, or when it is 0, an eighth of
    the context window rounded up to 64 (a coarse step: a batch's longest trajectory varies
    by a few tokens from step to step, and each width is an update program of its own)."""
    return pad_multiple or round_up(-(-max_model_len // 8), 64)
