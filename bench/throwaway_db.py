"""Run a bench against a throwaway test database on ``DATABASE_URL``'s server (created, then dropped)."""

from __future__ import annotations

from collections.abc import Callable


def in_throwaway_database(run: Callable[[], int]) -> int:
    """``django.setup()``, create Django's test database (``test_<name>``, replacing a leftover one), return
    ``run()``, then close the connection and drop the database whatever happened."""
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        return run()
    finally:
        connection.close()
        connection.creation.destroy_test_db(old_name, verbosity=0)
