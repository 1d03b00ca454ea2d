"""Count collectives at the c10d level: every c10d op passes the dispatcher, whoever issued it.

The counter and its op table are the library's own (``fullshard bench`` reports with them), so
what bench calls an all-gather is what these tests check.
"""

from __future__ import annotations

from fullshard.observe.c10d_counter import KINDS, C10dCounter

__all__ = ["KINDS", "RS", "C10dCounter"]

# What fullshard's reduce-scatter is at the c10d level on gloo: an all-to-all of the same bytes
# followed by a local sum (NOTE [Reduce-scatter on gloo]).
RS = "all_to_all"
