"""engine layer of fullshard (see DESIGN.md)."""
