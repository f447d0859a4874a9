"""The folder of the file ms-swift loads with ``--external_plugins`` (swift puts the
file's folder first on ``sys.path``, so it holds nothing else to shadow)."""
