"""One module per command (layer 11): ``train``, ``convert``, ``prepare``, ``plan``, ``trace``
and ``bench``, each with its options, its validation (once per launch, before any rank starts)
and its run; the checks they share (``checks.py``), and the parts of the larger ones (plan's
``--check`` and ``--calibrate``, bench's variants and report)."""
