"""Applications built on the fullshard engine: models, data, the trainer and the CLI (layer 11).

Nothing here is imported by the engine; ``fullshard.app.cli:main`` is the ``fullshard`` command.
"""
