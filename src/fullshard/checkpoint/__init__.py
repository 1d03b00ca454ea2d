"""Checkpoints (layer 9): state dicts, sharded save/load with atomic commit, full export, sharded
safetensors load."""

from fullshard.checkpoint.export import convert, export_safetensors, full_state_dict
from fullshard.checkpoint.safetensors_load import (
    LoadReport,
    check_safetensors,
    load_safetensors,
)
from fullshard.checkpoint.state_dict import get_state_dict, set_state_dict
from fullshard.checkpoint.store import CheckpointManager, latest_checkpoint, verify

__all__ = [
    "CheckpointManager",
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
