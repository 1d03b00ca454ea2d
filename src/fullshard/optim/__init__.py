"""Optimizers over sharded parameters (layer 9): whole-matrix updates (Muon) split across ranks,
each matrix on one owner, one process's answer bit for bit (NOTE [Whole-matrix optimizers],
NOTE [Matrices on owners])."""

# Names load on first use (PEP 562), as the other packages' do.

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.optim.matrix import MatrixOptimizer, hidden_matrix, matrix_groups
    from fullshard.optim.muon import Muon

__all__ = ["MatrixOptimizer", "Muon", "hidden_matrix", "matrix_groups"]

_SOURCES = {
    "MatrixOptimizer": "fullshard.optim.matrix",
    "hidden_matrix": "fullshard.optim.matrix",
    "matrix_groups": "fullshard.optim.matrix",
    "Muon": "fullshard.optim.muon",
}

__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
