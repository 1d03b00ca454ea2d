"""Applications built on the fullshard engine (layer 11): the ``fullshard`` command and what it
runs, one folder per concern.

- ``cli.py``: the command line (parses, validates once, calls); ``config.py`` the run's
  configuration (``TrainConfig``) and its options; ``dims.py`` the parallel dimensions;
  ``errors.py`` the input error every command raises.
- ``train/``: the training job on one rank. ``launch/``: how ranks start and stop.
  ``data/``: text in. ``models/``: the models and how they are sharded. ``commands/``: the
  other commands and the validation before any launch.

Nothing here is imported by the engine; ``fullshard.app.cli:main`` is the ``fullshard`` command.
"""
