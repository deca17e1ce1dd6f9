"""``hisparse presets`` and ``hisparse plan`` commands (stub; filled in shortly)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the ``presets`` sub-app and the ``plan`` command to ``app``."""
    presets_app = typer.Typer(help="List and show presets.", invoke_without_command=True)

    @presets_app.callback()
    def _presets(ctx: typer.Context) -> None:
        """List the presets."""

    app.add_typer(presets_app, name="presets")

    @app.command("plan")
    def _plan() -> None:
        """Capacity plan (not yet implemented)."""
        raise typer.Exit(2)
