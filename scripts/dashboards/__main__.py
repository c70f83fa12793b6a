"""``python -m scripts.dashboards``: write dashboards/*.json."""

from scripts.dashboards import write

write()
