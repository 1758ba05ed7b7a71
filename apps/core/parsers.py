"""The API's JSON parser: DRF's, with a body nested too deeply for Python's parser answered as a 400.

``json.load`` recurses once per nesting level and raises ``RecursionError`` (not ``ValueError``) past the
interpreter's recursion limit (about 1000 levels), which DRF's :class:`~rest_framework.parsers.JSONParser` does
not catch: a 10 KB body of ``[`` was a 500 on every endpoint that reads a body. Here it is a
:class:`~rest_framework.exceptions.ParseError` (400 ``{"detail": "JSON parse error - ..."}``) like any other
malformed JSON. No Ferry request body nests more than a few levels.
"""

from __future__ import annotations

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class SafeJSONParser(JSONParser):
    """DRF's JSON parser (strict: no ``NaN``/``Infinity``); raises ParseError for any malformed body, including
    one nested deeper than the interpreter's recursion limit."""

    def parse(self, stream, media_type=None, parser_context=None):  # noqa: ANN001, ANN201 - DRF signature
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body nests too deeply (a request body nests a few levels at "
                             "most).") from None
