"""Agent URLs checked and shown without their secrets (``dispatcher/urls.py``)."""

from __future__ import annotations

import pytest

from dispatcher.urls import agent_url_problem, redact_url, redact_urls, replica_names


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://agent:8000", "http://agent:8000"),
        ("http://u:pw@agent:8000", "http://u:***@agent:8000"),
        ("http://TOKEN@agent:8000", "http://***@agent:8000"),
        ("http://u:p@ss/w?rd#@agent:8000", "http://u:***@agent:8000"),  # unescaped in the password
        ("=http://u:pw@agent", "=http://u:***@agent"),  # not a URL: masked all the same
    ],
)
def test_a_url_is_shown_without_its_secret(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_list_of_urls_is_shown_without_any_secret() -> None:
    assert redact_urls("http://a:1@h:1,http://b:2@h:2") == "http://a:***@h:1,http://b:***@h:2"


def test_replicas_that_differ_only_in_their_secrets_are_told_apart() -> None:
    urls = ["http://u:1@h:1", "http://u:2@h:1", "http://h:2", "http://u:1@h:1"]
    assert replica_names(urls) == [
        "http://u:***@h:1",
        "http://u:***@h:1#2",
        "http://h:2",
        "http://u:***@h:1#3",
    ]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h:8000", None),
        ("https://u:pw@h:443/base/", None),
        ("http://h :8000", "contains white space"),
        ("ftp://h:21", "is not an http(s) URL"),
        ("http://h:0", "has a port outside 1-65535"),
        (
            "http://a%3Ab:pw@h:1",
            "has a ':' (%3A) in its user name, which Basic auth cannot send (RFC 7617)",
        ),
        (
            "http://h:1/?x=1",
            "has a query or fragment (the dispatcher appends /run to the base URL)",
        ),
        ("http://h:1/agent/run", "ends in /run: give the base URL, the dispatcher appends /run"),
    ],
)
def test_what_cannot_be_an_agents_base_url_says_why(url: str, problem: str | None) -> None:
    assert agent_url_problem(url) == problem
