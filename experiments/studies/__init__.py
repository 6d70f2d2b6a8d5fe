"""Learning and behaviour studies on the tiny presets and real models:
``python -m experiments.studies.<study>``."""
