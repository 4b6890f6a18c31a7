"""bench.step_history's blocks: what a user may ask for, and the one-line refusal of the rest; the usage it logs."""

import mmap

import click
import pytest

from bench.ranks import process_usage
from bench.step_history import parse_blocks


def test_blocks_take_their_own_rounds_or_the_common_count():
    assert parse_blocks("alone:20, all:2,alone") == [("alone", 20), ("all", 2), ("alone", None)]


@pytest.mark.parametrize("text", ["alone,sideways", "all:0", "alone:two", "beside:-1", " , "])
def test_a_bad_block_is_refused_with_its_name(text):
    with pytest.raises(click.BadParameter, match="bad block|no blocks"):
        parse_blocks(text)


def test_process_usage_counts_the_page_faults_of_fresh_memory_and_splits_user_from_kernel():
    pages = mmap.mmap(-1, 64 << 20)  # anonymous memory, mapped on first write
    pages.madvise(mmap.MADV_NOHUGEPAGE)  # 4 KiB pages whatever the machine's transparent huge pages setting
    before = process_usage()
    for offset in range(0, len(pages), 4096):
        pages[offset] = 1
    used = process_usage() - before
    assert used.faults >= 16000  # 16384 pages, each faulted on its first write
    assert used.user_ms >= 0 and used.system_ms >= 0
    assert used.cpu_ms == pytest.approx(used.user_ms + used.system_ms)
    pages.close()
