"""Queries the ORM builds and compiles once per process, then runs with new parameter values.

Building a ``QuerySet`` (``filter``, ``select_related``, ``annotate``) and compiling it to SQL cost more CPU than
running a small indexed look-up on PostgreSQL and reading its row: for the API token look-up of every API request
(:mod:`apps.accounts.authentication`) about 0.85 ms of 1.7 ms in-process (issue 21: per-request cost).
:class:`PreparedQuery` keeps the ORM as the one author of the SQL (joins, quoting, the model's columns, the
aggregate's ``FILTER``) and does that work once: the query is built with a marker in place of each parameter,
compiled, and each run substitutes the values into the compiled parameter list. Rows come back as ``values()``
gives them: dicts keyed by the selected names, each value through the same converters (Django's
``SQLCompiler.get_converters``, e.g. JSON decoding).
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import QuerySet
from django.db.models.query import ValuesIterable


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    params: tuple
    slots: list[tuple[int, str]]
    """(index in params, parameter name) of each marker."""
    columns: list[str]
    converters: list[tuple[int, tuple[list, Any]]]
    """(column index, (converter functions, expression)) as ``SQLCompiler.get_converters`` gives them."""


class PreparedQuery:
    """A ``values()`` query compiled once per database alias and run with new parameter values.

    Args:
        build: a function of keyword-only parameters returning the ``QuerySet.values(...)`` to run. It is called
            once per database alias with a marker string for each parameter; each marker must reach the compiled
            query's parameters unchanged (a text value in an ``exact`` or ``in`` lookup, not inside ``contains`` or
            a cast), and the query must not depend on anything else that changes between runs (the time, settings).
        using: the database alias.

    Raises (on the first :meth:`rows`):
        ImproperlyConfigured: ``build`` does not return a ``values()`` query, or a marker is missing from or
            altered in the compiled parameters.
    """

    def __init__(self, build: Callable[..., QuerySet], *, using: str = DEFAULT_DB_ALIAS) -> None:
        self._build = build
        self.using = using
        self._names = [name for name, parameter in inspect.signature(build).parameters.items()
                       if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
        self._compiled: _Compiled | None = None

    def _compile(self) -> _Compiled:
        markers = {name: f"ferry-prepared-{name}-{secrets.token_hex(16)}" for name in self._names}
        queryset = self._build(**markers)
        if not isinstance(queryset, QuerySet) or queryset._iterable_class is not ValuesIterable:
            raise ImproperlyConfigured(f"{self._build.__qualname__} must return a QuerySet.values(...) query")
        query = queryset.query
        compiler = query.get_compiler(self.using)
        sql, params = compiler.as_sql()
        by_marker = {marker: name for name, marker in markers.items()}
        slots = [(index, by_marker[value]) for index, value in enumerate(params)
                 if isinstance(value, str) and value in by_marker]
        missing = set(self._names) - {name for _, name in slots}
        altered = {name for value in params if isinstance(value, str) and value not in by_marker
                   for marker, name in by_marker.items() if marker in value}
        if missing or altered:
            raise ImproperlyConfigured(f"{self._build.__qualname__}: parameters {sorted(missing | altered)} do not "
                                       "reach the SQL as given (use them in exact or in lookups)")
        # the names ValuesIterable gives the columns, and the converters results_iter applies (Django 5.2)
        columns = list(query.selected) if query.selected else [*query.extra_select, *query.values_select,
                                                                 *query.annotation_select]
        converters = compiler.get_converters([select[0] for select in compiler.select[:compiler.col_count]])
        return _Compiled(sql, tuple(params), slots, columns, list(converters.items()))

    def rows(self, **values: Any) -> list[dict[str, Any]]:  # noqa: ANN401 - the parameters' values
        """Run the query with ``values`` for its parameters: every row as a dict of the selected names.

        Raises:
            TypeError: a parameter is missing or unknown.
            django.db.Error: the database's errors, as a QuerySet raises them.
        """
        if set(values) != set(self._names):
            raise TypeError(f"expected parameters {sorted(self._names)}, got {sorted(values)}")
        compiled = self._compiled
        if compiled is None:  # two threads may both compile; either result is the same
            compiled = self._compiled = self._compile()
        params = list(compiled.params)
        for index, name in compiled.slots:
            params[index] = values[name]
        connection = connections[self.using]
        with connection.cursor() as cursor:
            cursor.execute(compiled.sql, params)
            fetched = cursor.fetchall()
        columns, converters = compiled.columns, compiled.converters
        out = []
        for row in fetched:
            if converters:
                row = list(row)
                for position, (functions, expression) in converters:
                    value = row[position]
                    for function in functions:
                        value = function(value, expression, connection)
                    row[position] = value
            out.append(dict(zip(columns, row, strict=True)))
        return out

