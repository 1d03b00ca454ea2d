"""dist layer of fullshard (see DESIGN.md)."""
