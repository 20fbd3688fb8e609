"""The fast paths: speed-ups for one backend or one model size, each a strategy that a seam of
the plain path takes, chosen once per run (``strategies.py``) from the switch that
``platform/fast_paths.py`` reads."""
