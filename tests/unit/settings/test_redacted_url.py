"""A printed store URL never shows its password, whatever shape the URL has."""

from __future__ import annotations

import pytest

from tidepool.settings import redacted_url


@pytest.mark.parametrize("url, shown", [
    ("postgresql://tp:TopSecret99@db.example:5432/tidepool", "postgresql://tp:***@db.example:5432/tidepool"),
    ("postgresql://:TopSecret99@db.example/tidepool", "postgresql://:***@db.example/tidepool"),  # no user
    ("postgresql://tp:Top@Secret@99@db.example/tidepool", "postgresql://tp:***@db.example/tidepool"),  # @ in it
    ("postgresql://tp:Top/Secret?99@db.example/tidepool", "postgresql://tp:***@db.example/tidepool"),
    ("mysql://root:TopSecret99@db.example/x", "mysql://root:***@db.example/x"),  # a scheme tidepool does not know
    ("postgres://tp@db.example/tidepool?password=TopSecret99&schema=a", "postgres://tp@db.example/tidepool?password=***&schema=a"),
    ("postgresql://tp@db.example/t?sslpassword=TopSecret99", "postgresql://tp@db.example/t?sslpassword=***"),
    ("host=db.example password=TopSecret99", "host=db.example password=***"),  # not a URL at all
    ("host=db.example password='Top Secret99' user=tp", "host=db.example password=*** user=tp"),  # quoted
    ("host=db.example password='Top \\' Secret99' user=tp", "host=db.example password=*** user=tp"),
    ("host=db.example password='Top Secret99", "host=db.example password=***"),  # unclosed: to the end
    ("postgresql://tp@db.example/tidepool", "postgresql://tp@db.example/tidepool"),  # nothing to hide
    ("sqlite:///var/lib/tidepool/tidepool.db", "sqlite:///var/lib/tidepool/tidepool.db"),
    ("https://gateway.example:8471", "https://gateway.example:8471"),
    ("memory://", "memory://"),
])
def test_a_store_urls_password_is_never_shown(url: str, shown: str) -> None:
    assert redacted_url(url) == shown
    assert "TopSecret99" not in redacted_url(url) and "Secret" not in redacted_url(url)
