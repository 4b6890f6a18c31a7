"""runtime.recording.process_usage: the page faults and the kernel's share of what a process ran."""

import mmap

import pytest

from runtime.recording.process_usage import process_usage


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
