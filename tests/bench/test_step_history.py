"""bench.step_history's blocks: what a user may ask for, and the one-line refusal of the rest."""

import click
import pytest

from bench.step_history import parse_blocks


def test_blocks_take_their_own_rounds_or_the_common_count():
    assert parse_blocks("alone:20, all:2,alone") == [("alone", 20), ("all", 2), ("alone", None)]


@pytest.mark.parametrize("text", ["alone,sideways", "all:0", "alone:two", "beside:-1", " , "])
def test_a_bad_block_is_refused_with_its_name(text):
    with pytest.raises(click.BadParameter, match="bad block|no blocks"):
        parse_blocks(text)
