"""`watchdog dashboards ...`: export the generated Grafana dashboards, or push them to a Grafana."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from ppo_watchdog.observe import grafana

log = logging.getLogger(__name__)

dashboards_app = typer.Typer(help="Grafana dashboards as code: export the JSON or push it to a Grafana.",
                             no_args_is_help=True)


@dashboards_app.command("export")
def export(
    directory: Annotated[Path, typer.Argument(help="Directory to write the dashboard JSON files into.")],
) -> None:
    """Write every dashboard as JSON (fixed uids) into DIRECTORY."""
    from ppo_watchdog.observe import dashboards

    try:
        written = dashboards.export(directory)
    except OSError as exc:
        typer.echo(f"error: {directory}: cannot write the dashboards there "
                   f"({exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''})", err=True)
        raise typer.Exit(2) from None
    for path in written:
        typer.echo(str(path))


@dashboards_app.command("push")
def push(
    url: Annotated[str, typer.Option(help="Grafana base URL, e.g. http://127.0.0.1:3000.",
                                     envvar="GRAFANA_URL")],
    token_file: Annotated[Path | None, typer.Option(
        help=f"File holding the Grafana token (else ${grafana.TOKEN_FILE_ENV} or ${grafana.TOKEN_ENV}).")] = None,
    folder_uid: Annotated[str | None, typer.Option(help="Grafana folder uid to put the dashboards in.")] = None,
) -> None:
    """Create or replace the dashboards in a Grafana (POST /api/dashboards/db, overwrite)."""
    try:
        token = grafana.load_token(token_file)
    except grafana.TokenError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if token is None:
        typer.echo(f"error: no Grafana token: set ${grafana.TOKEN_ENV}, ${grafana.TOKEN_FILE_ENV} or --token-file",
                   err=True)
        raise typer.Exit(2)
    client = grafana.Grafana(url, token)
    try:
        uids = grafana.push_all(client, folder_uid=folder_uid)
    except grafana.GrafanaError as exc:  # refused (a wrong token) or unreachable: a setting to fix, exit 2
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    for uid in uids:
        typer.echo(f"pushed {uid} to {grafana.redact_url(url)}")
