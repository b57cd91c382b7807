"""The offloaded cold tier's page file (:class:`confkv.page_file.PageFile`): tensors it hands out
are backed by its file, and once closed the file is shut and refuses new tensors.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md).
"""

import pytest
import torch

from confkv.page_file import PageFile


def test_close_shuts_the_file_refuses_new_tensors_and_can_be_repeated(tmp_path):
    pages = PageFile(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked at once
    tensor = pages.allocate((2, 3), torch.float16)
    tensor.fill_(1.5)
    assert tensor.tolist() == [[1.5] * 3] * 2 and pages.live_bytes == 12 and pages.file_bytes == 12
    handle = pages.file
    pages.close()
    assert handle.closed
    with pytest.raises(RuntimeError, match="page file is closed"):
        pages.allocate((1,), torch.float32)
    pages.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match="page file is closed"):
        pages.allocate((1,), torch.float32)
