"""The suite never touches the user's own data dir: `make test` right after `make qualify` must not read
the keys or store that `make qualify` left there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import platformdirs

from qualify import settings


def test_the_suite_runs_with_its_own_qualify_home_not_the_users():
    user = Path(platformdirs.user_data_dir("qualify", appauthor=False))
    here = settings.data_dir()
    assert here != user
    assert str(here).startswith(tempfile.gettempdir())
    assert "QUALIFY_DB_URL" not in os.environ
    assert settings.default_db_url() == f"sqlite:///{here / 'qualify.db'}"
