"""Page-number pagination for every list endpoint (``?page=N&page_size=M``, at most 500 rows).

``page`` and ``page_size`` are validated: a value that is not a whole number in range is a 400 naming the
parameter (DRF's default silently falls back to the default page size and answers 404 "Invalid page").
A well-formed page past the last one stays a 404.

A list that fits on its first page (the common case: a fleet's pools, clusters, rollouts) is answered with
one query: the first page is read with one row more than the page size, and when that extra row is absent
the row count is the number read, so no ``COUNT(*)`` is sent. Longer lists and later pages count as usual.
"""

from django.core.paginator import Paginator
from rest_framework.pagination import PageNumberPagination

from apps.core.filters import query_int

MAX_PAGE = 2**31 - 1


class FirstPagePaginator(Paginator):
    """Django's paginator without the ``COUNT(*)`` of a first page that holds every row."""

    def page(self, number):  # noqa: ANN001, ANN201 - Django's signature
        if str(number) != "1" or "count" in self.__dict__:
            return super().page(number)
        rows = list(self.object_list[: self.per_page + 1])
        if len(rows) <= self.per_page:
            self.count = len(rows)  # fills the cached_property: num_pages and the response's count use it
        return self._get_page(rows[: self.per_page], self.validate_number(1), self)


class Pagination(PageNumberPagination):
    django_paginator_class = FirstPagePaginator
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500

    def get_page_size(self, request) -> int:
        return query_int(request.query_params, self.page_size_query_param, default=self.page_size,
                         min_value=1, max_value=self.max_page_size)

    def get_page_number(self, request, paginator) -> int | str:
        if request.query_params.get(self.page_query_param) in self.last_page_strings:
            return super().get_page_number(request, paginator)
        return query_int(request.query_params, self.page_query_param, default=1, min_value=1, max_value=MAX_PAGE)

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.page_query_param: (1, MAX_PAGE), self.page_size_query_param: (1, self.max_page_size)}
        for parameter in parameters:
            if parameter["name"] in bounds:
                parameter["schema"]["minimum"], parameter["schema"]["maximum"] = bounds[parameter["name"]]
        return parameters
