"""Checkpoints (layer 9): state dicts, sharded save/load with atomic commit, full export, sharded
safetensors load."""

# Names load on first use (PEP 562): ``import fullshard.checkpoint.store`` runs this file first,
# and eager re-exports would pull in torch.distributed.checkpoint and DTensor for a caller (the
# launcher's resume check) that only reads a manifest.

from __future__ import annotations

from typing import TYPE_CHECKING

from fullshard._lazy import lazy_exports

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from fullshard.checkpoint.export import convert, export_safetensors, full_state_dict
    from fullshard.checkpoint.safetensors_load import (
        LoadReport,
        check_safetensors,
        load_safetensors,
    )
    from fullshard.checkpoint.state_dict import get_state_dict, set_state_dict
    from fullshard.checkpoint.store import (
        CheckpointDiskFull,
        CheckpointManager,
        CheckpointSaveFailed,
        latest_checkpoint,
        verify,
    )

__all__ = [
    "CheckpointDiskFull",
    "CheckpointManager",
    "CheckpointSaveFailed",
    "LoadReport",
    "check_safetensors",
    "convert",
    "export_safetensors",
    "full_state_dict",
    "get_state_dict",
    "latest_checkpoint",
    "load_safetensors",
    "set_state_dict",
    "verify",
]

# public name -> the module that defines it (the TYPE_CHECKING imports above, as data)
_SOURCES = {
    "convert": "fullshard.checkpoint.export",
    "export_safetensors": "fullshard.checkpoint.export",
    "full_state_dict": "fullshard.checkpoint.export",
    "LoadReport": "fullshard.checkpoint.safetensors_load",
    "check_safetensors": "fullshard.checkpoint.safetensors_load",
    "load_safetensors": "fullshard.checkpoint.safetensors_load",
    "get_state_dict": "fullshard.checkpoint.state_dict",
    "set_state_dict": "fullshard.checkpoint.state_dict",
    "CheckpointDiskFull": "fullshard.checkpoint.store",
    "CheckpointManager": "fullshard.checkpoint.store",
    "CheckpointSaveFailed": "fullshard.checkpoint.store",
    "latest_checkpoint": "fullshard.checkpoint.store",
    "verify": "fullshard.checkpoint.store",
}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _SOURCES)
