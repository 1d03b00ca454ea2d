"""Checkpoints (layer 9): state dicts, sharded save/load with atomic commit, full export."""

from fullshard.checkpoint.export import convert, export_safetensors, full_state_dict
from fullshard.checkpoint.state_dict import get_state_dict, set_state_dict
from fullshard.checkpoint.store import CheckpointManager, latest_checkpoint, verify

__all__ = [
    "CheckpointManager",
    "convert",
    "export_safetensors",
    "full_state_dict",
    "get_state_dict",
    "latest_checkpoint",
    "set_state_dict",
    "verify",
]
