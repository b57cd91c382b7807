"""The tests' thread-count helper (tests/thread_counts.py) restores the count however its block ends."""

import pytest
import torch

from thread_counts import torch_threads


def test_the_count_is_restored_after_a_failing_block():
    before = torch.get_num_threads()
    with pytest.raises(AssertionError), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        torch.set_num_threads(before + 2)  # a block may set it again
        raise AssertionError("the block failed")
    assert torch.get_num_threads() == before
