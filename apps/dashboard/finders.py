"""A static-files finder that serves plotly.js from the installed ``plotly`` Python package.

plotly.min.js (~4.6 MB) is not committed: the ``plotly`` package ships it as
``plotly/package_data/plotly.min.js``, and this finder exposes that file as the static path
``dashboard/vendor/plotly.min.js``. ``collectstatic`` copies it into ``STATIC_ROOT`` like any
other static file (WhiteNoise serves it in production); with ``DEBUG`` on, WhiteNoise serves it
straight from the finder. The dashboard therefore loads no script from a CDN and works offline.

Enable it in ``STATICFILES_FINDERS`` (after Django's two default finders).
"""

from __future__ import annotations

from pathlib import Path

from django.contrib.staticfiles.finders import BaseFinder
from django.core.checks import Error
from django.core.files.storage import FileSystemStorage

PLOTLY_STATIC_DIR = "dashboard/vendor"
PLOTLY_FILE = "plotly.min.js"
PLOTLY_STATIC_PATH = f"{PLOTLY_STATIC_DIR}/{PLOTLY_FILE}"


def plotly_package_data_dir() -> Path:
    """The ``package_data`` directory of the installed ``plotly`` package (holds ``plotly.min.js``)."""
    import plotly

    return Path(plotly.__file__).resolve().parent / "package_data"


class PlotlyFinder(BaseFinder):
    """Finds ``dashboard/vendor/plotly.min.js`` in the ``plotly`` package; nothing else."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.storage = FileSystemStorage(location=str(plotly_package_data_dir()))
        self.storage.prefix = PLOTLY_STATIC_DIR

    def check(self, **kwargs):
        path = plotly_package_data_dir() / PLOTLY_FILE
        if not path.is_file():
            return [Error(f"{path} is missing: install the plotly package (requirements.txt) to serve plotly.js",
                          id="dashboard.E001")]
        return []

    def find(self, path, find_all=False, **kwargs):
        find_all = find_all or kwargs.get("all", False)
        if path != PLOTLY_STATIC_PATH:
            return [] if find_all else None
        found = str(plotly_package_data_dir() / PLOTLY_FILE)
        return [found] if find_all else found

    def list(self, ignore_patterns):
        yield PLOTLY_FILE, self.storage
