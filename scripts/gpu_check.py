"""GPU check: every CLI command on NCCL, and every strategy with ranks sharing one GPU over gloo.

    python scripts/gpu_check.py                         # on a machine with a GPU
    python scripts/gpu_check.py --cpu                   # the same checks on gloo/CPU
    python scripts/gpu_check.py --cpu --list            # the check names
    python scripts/gpu_check.py --only 'cli.*,gloo4.*'  # a subset; --quick

The checks are tests under ``tests/gpu/`` (``make test-gpu`` runs them with pytest, one test per
check, skipped without CUDA); this entry point runs the same driver (``tests/gpu/gpu_check.py``)
as one command, one ``PASS``/``FAIL`` line per check, and exits non-zero if any fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

from gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
