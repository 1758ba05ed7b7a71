"""Page-number pagination for every list endpoint (``?page=N&page_size=M``, at most 500 rows).

``page`` and ``page_size`` are validated: a value that is not a whole number in range is a 400 naming the
parameter (DRF's default silently falls back to the default page size and answers 404 "Invalid page").
A well-formed page past the last one stays a 404.
"""

from rest_framework.pagination import PageNumberPagination

from apps.core.filters import query_int

MAX_PAGE = 2**31 - 1


class Pagination(PageNumberPagination):
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
