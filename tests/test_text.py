"""Counts and rates in user-facing sentences."""

from specheads.plumbing.text import count, rate


def test_a_count_takes_its_noun_in_the_right_number():
    assert count(1, "test prompt") == "1 test prompt"
    assert count(3, "test prompt") == "3 test prompts"
    assert count(0, "prompt") == "0 prompts"
    assert count(2, "reply", "replies") == "2 replies"


def test_a_small_rate_is_never_printed_as_zero():
    assert rate(0.42) == "0.42" and rate(7.25) == "7.25"
    assert rate(12345.6) == "12,346"
