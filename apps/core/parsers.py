"""The API's JSON parser: DRF's, with a body nested too deeply for Python's parser answered as a 400.

``json.load`` recurses once per nesting level and raises ``RecursionError`` (not ``ValueError``) past the
interpreter's recursion limit (about 1000 levels), which DRF's :class:`~rest_framework.parsers.JSONParser` does
not catch: a 10 KB body of ``[`` was a 500 on every endpoint that reads a body. Here it is a
:class:`~rest_framework.exceptions.ParseError` (400 ``{"detail": "JSON parse error - ..."}``) like any other
malformed JSON. No Ferry request body nests more than a few levels.

A ``\\ud800`` escape without its pair is valid JSON text but not Unicode: Python's parser makes it a lone
surrogate, which nothing can encode as UTF-8. A field named so was a 500 (text/plain) on every write endpoint,
since the 400 naming the unknown field could not be rendered; as a value it would fail at the database. Such a
body is a 400 here, before any view reads it.
"""

from __future__ import annotations

import json

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class SafeJSONParser(JSONParser):
    """DRF's JSON parser (strict: no ``NaN``/``Infinity``); raises ParseError for any malformed body, including
    one nested deeper than the interpreter's recursion limit and one with a lone UTF-16 surrogate escape."""

    def parse(self, stream, media_type=None, parser_context=None):  # noqa: ANN001, ANN201 - DRF signature
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply (a request body nests a few levels at "
                             "most).") from None
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ParseError(f"JSON parse error - the body has a lone UTF-16 surrogate (\\u{ord(exc.object[exc.start]):04x} "
                             "escape without its pair): not valid Unicode.") from None
        return data
