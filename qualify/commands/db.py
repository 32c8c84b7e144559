"""`qualify db upgrade|current`: bring the store's schema to head, or say which revision it is at."""

from __future__ import annotations

import click

from qualify.commands._common import console, db_option, emit, json_option, opened, resolve_db, store_errors


@click.group("db")
def db() -> None:
    """The store's database schema (Alembic migrations; they are also applied on first use)."""


@db.command("upgrade")
@db_option
@json_option
@store_errors
def upgrade(db_url: str | None, as_json: bool) -> None:
    """Create the store if needed and apply every migration."""
    from receipts.db import head_revision
    from receipts.store import Store

    with opened(Store.open(resolve_db(db_url), create=True)) as store:
        revision = store.revision()
        data = {
            "url": store.url,
            "revision": revision,
            "head": head_revision(),
            "role": store.db_role.to_json(),
        }
        emit(as_json, data, lambda: console.print(f"store {data['url']} is at revision {revision} (head)"))


@db.command("current")
@db_option
@json_option
@store_errors
def current(db_url: str | None, as_json: bool) -> None:
    """Print the schema revision of the store, changing nothing."""
    from receipts.db import check_connection, create_engine, head_revision, parse_url, shown, writer_role

    url = parse_url(resolve_db(db_url))
    engine = create_engine(url, create=False)
    try:
        revision = check_connection(engine)
        role = writer_role(engine, grant=False).to_json()  # a probe: grants nothing
    finally:
        engine.dispose()
    head = head_revision()
    data = {"url": shown(url), "revision": revision, "head": head, "at_head": revision == head, "role": role}
    status = "at head" if revision == head else f"behind head {head}; run: qualify db upgrade"
    emit(
        as_json, data, lambda: console.print(f"store {data['url']}: revision {revision or 'none'}, {status}")
    )
