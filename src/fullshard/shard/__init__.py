"""shard layer of fullshard (see DESIGN.md)."""
