"""hisparse_cli: the ``hisparse`` command, job manifests, the dashboard and output files."""
