"""The commands besides train (layer 11): the one validation pass before any launch, bench,
plan, plan --check and trace."""
