"""Applications built on the fullshard engine (layer 11): the ``fullshard`` command and what it
runs, one folder per concern.

Its parts, ground first; each imports only the parts before it (and itself):
``errors``, ``dims``, ``faults``, ``config``, ``models``, ``data``, ``launch``, ``train``,
``commands``, ``cli``.

- ``errors.py``: the input error every command raises, and a run's expected endings;
  ``dims.py``: the parallel dimensions; ``faults.py``: fault injection for drills;
  ``config.py``: ``fullshard train``'s configuration (``TrainConfig``) and its options.
- ``models/``: the models and how they are sharded. ``data/``: text in. ``launch/``: how ranks
  start and stop. ``train/``: the training job on one rank.
- ``commands/``: one module per command (its options, validation and run); ``cli.py``: the
  parser built from them, and the dispatch.

Nothing here is imported by the engine; ``fullshard.app.cli:main`` is the ``fullshard`` command.
"""
