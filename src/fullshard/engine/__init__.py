"""The engine (layers 5 to 8): sharded parameters, units, scheduling, hooks and ``fully_shard``."""
