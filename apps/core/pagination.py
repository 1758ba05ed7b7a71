"""Page-number pagination for every list endpoint (``?page=N&page_size=M``, at most 500 rows).

A list that fits on its first page (the common case: a fleet's pools, clusters, rollouts) is answered with
one query: the first page is read with one row more than the page size, and when that extra row is absent
the row count is the number read, so no ``COUNT(*)`` is sent. Longer lists and later pages count as usual.
"""

from django.core.paginator import Paginator
from rest_framework.pagination import PageNumberPagination


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
