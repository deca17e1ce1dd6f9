"""``python -m hisparse_cli`` runs the ``hisparse`` command."""

from hisparse_cli.main import app

app()
