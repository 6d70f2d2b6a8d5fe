"""ml_collections config files: ``base.py`` holds every default, one file per env overrides."""
