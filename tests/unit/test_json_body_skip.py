"""json_to_metadata is skipped for a whole answer larger than Envoy's buffer limit: the
content-length regex matches exactly the numbers above it (RE2 syntax, Python's re agrees
on this subset)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from gateway.envoyconf.bootstrap import BUFFER_HEADROOM_BYTES
from gateway.envoyconf.metering import above_regex, json_to_metadata_filter


@given(limit=st.integers(0, 10**12), n=st.integers(0, 10**13))
def test_the_regex_matches_exactly_the_numbers_above_the_limit(limit: int, n: int) -> None:
    r = re.compile(above_regex(limit))
    assert bool(r.match(str(n))) == (n > limit)
    assert bool(r.match("00" + str(n))) == (n > limit)  # leading zeros are the same number


def test_around_the_limit() -> None:
    limit = 8 * 1024 * 1024 + BUFFER_HEADROOM_BYTES
    r = re.compile(above_regex(limit))
    for n in range(limit - 2000, limit + 2000):
        assert bool(r.match(str(n))) == (n > limit), n
    assert not r.match("") and not r.match("12ab") and not r.match("-9999999999")


def test_the_filter_skips_json_to_metadata_past_the_limit() -> None:
    d = json_to_metadata_filter(1234).to_dict()
    [m] = d["xdsMatcher"]["matcherList"]["matchers"]
    single = m["predicate"]["singlePredicate"]
    assert single["input"]["typedConfig"]["headerName"] == "content-length"
    assert single["valueMatch"]["safeRegex"]["regex"] == above_regex(1234)
    assert m["onMatch"]["action"]["typedConfig"]["@type"].endswith("SkipFilter")
    assert d["extensionConfig"]["name"] == "envoy.filters.http.json_to_metadata"
