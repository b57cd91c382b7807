"""The offloaded cold tier's page file (:class:`confkv.tiers.page_file.PageFile`): tensors it hands out
are backed by its file at 64-byte aligned offsets, the file's size is what ``file_bytes`` says,
a bad directory gives a ConfigError naming ``offload_dir`` and the directory, the unlinked file
keeps a recognisable name (what ``lsof`` or ``ls -l /proc/PID/fd`` shows an operator looking
for the process that holds the disk space), and once closed the file is shut and refuses new
tensors.

Written to kill the mutants that survived ``make mutate`` (docs/MUTATION.md). Expected bytes
and sizes are worked out by hand (struct packing, the 64-byte alignment rule).
"""

import errno
import os
import re
import struct
import sys

import pytest
import torch

from confkv.errors import ConfigError
from confkv.tiers.page_file import PageFile


def test_close_shuts_the_file_refuses_new_tensors_and_can_be_repeated(tmp_path):
    pages = PageFile(str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # unlinked at once
    tensor = pages.allocate((2, 3), torch.float16)
    tensor.fill_(1.5)
    assert tensor.tolist() == [[1.5] * 3] * 2 and pages.live_bytes == 12 and pages.file_bytes == 12
    handle = pages.file
    pages.close()
    assert handle.closed
    with pytest.raises(RuntimeError, match=r"^confkv: the page file is closed$"):
        pages.allocate((1,), torch.float32)
    pages.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match=r"^confkv: the page file is closed$"):
        pages.allocate((1,), torch.float32)


def test_tensors_live_in_the_file_at_aligned_offsets_and_file_bytes_is_its_size(tmp_path):
    pages = PageFile(str(tmp_path))
    fd = pages.file.fileno()

    one = pages.allocate((1,), torch.uint8)  # 1 byte at offset 0
    assert one.dtype == torch.uint8 and one.shape == (1,) and one.tolist() == [0]
    assert pages.file_bytes == 1 and os.fstat(fd).st_size == 1
    one.fill_(0xAB)
    assert os.pread(fd, 1, 0) == b"\xab"  # written through to the file, not a RAM copy

    halves = pages.allocate((2, 3), torch.float16)  # 12 bytes at offset 64 (1 rounded up to 64)
    assert halves.dtype == torch.float16 and halves.shape == (2, 3) and halves.tolist() == [[0.0] * 3] * 2
    assert pages.file_bytes == 76 and os.fstat(fd).st_size == 76
    values = [0.5, -1.0, 2.0, 3.25, -0.125, 100.0]
    halves.copy_(torch.tensor(values).reshape(2, 3))
    assert os.pread(fd, 12, 64) == struct.pack("<6e", *values)
    assert os.pread(fd, 1, 0) == b"\xab"  # the first tensor is untouched

    empty = pages.allocate((0, 3), torch.float16)  # no bytes; the file still grows by one, at 128
    assert empty.dtype == torch.float16 and empty.shape == (0, 3)
    assert pages.file_bytes == 129 and os.fstat(fd).st_size == 129
    assert pages.live_bytes == 1 + 12 + 0

    last = pages.allocate((1,), torch.uint8)  # next aligned offset: 192
    last.fill_(0x5C)
    assert pages.file_bytes == 193 and os.fstat(fd).st_size == 193
    assert os.pread(fd, 1, 192) == b"\x5c" and os.pread(fd, 1, 0) == b"\xab"
    pages.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the file's name from /proc/self/fd")
def test_the_unlinked_file_keeps_a_recognisable_name_in_the_directory(tmp_path):
    pages = PageFile(str(tmp_path))
    name = os.readlink(f"/proc/self/fd/{pages.file.fileno()}")
    pattern = re.escape(os.path.realpath(tmp_path)) + r"/confkv-pages-[a-z0-9_]{8}\.bin \(deleted\)"
    assert re.fullmatch(pattern, name), name
    pages.close()


def test_a_missing_directory_names_offload_dir_the_directory_and_the_fix(tmp_path, monkeypatch):
    missing = str(tmp_path / "no-such-dir")
    expected = (f"offload_dir: cannot create the page file in {missing!r} "
                f"({os.strerror(errno.ENOENT)}); pass a writable directory")
    with pytest.raises(ConfigError) as info:
        PageFile(missing)
    assert str(info.value) == expected
    # no directory given: the message names the system temp dir that failed
    monkeypatch.setattr("tempfile.tempdir", missing)
    with pytest.raises(ConfigError) as info:
        PageFile(None)
    assert str(info.value) == expected
