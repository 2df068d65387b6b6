import typer

app = typer.Typer(help="KV-Rescue batch evaluation", no_args_is_help=True)


@app.callback()
def main() -> None:
    """kvrescue: evicted-KV reasoning with a full-context helper and a PRM."""
