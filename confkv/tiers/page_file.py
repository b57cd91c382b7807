"""A memory-mapped file that holds a cache's offloaded cold pages (the CPU analogue of
GPU-to-host KV offload: ShadowKV, Sun et al. 2024; ArkVale, Chen et al. 2024; InfiniGen,
Lee et al. 2024).

One file per cache, created by :func:`tempfile.mkstemp` (mode 0600, an unpredictable name)
in ``directory`` (default: the system temp dir), named ``confkv-pages-XXXXXXXX.bin`` so that
``lsof`` shows whose deleted file holds the disk space, and unlinked at once: the pages live only
as long as the process holds the open file, so neither :meth:`close` nor a crash leaves a
file behind, and nothing else can open it by name. Tensors are carved from the file with
``numpy.memmap`` at growing offsets; space of released tensors is not reused (the file
grows to about twice the live pages, :attr:`file_bytes` reports it).
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from confkv.errors import ConfigError

_ALIGN = 64


class PageFile:
    """Allocator of file-backed tensors.

    Args:
        directory: where the file is created (None: :func:`tempfile.gettempdir`).
    Raises:
        ConfigError: the directory is missing or not writable (names ``offload_dir``).
    """

    def __init__(self, directory: str | None = None) -> None:
        try:
            fd, path = tempfile.mkstemp(prefix="confkv-pages-", suffix=".bin", dir=directory)
        except OSError as error:
            raise ConfigError(f"offload_dir: cannot create the page file in {directory or tempfile.gettempdir()!r} "
                              f"({error.strerror}); pass a writable directory") from error
        self.file = os.fdopen(fd, "r+b")
        os.unlink(path)
        self.file_bytes = 0
        self.live_bytes = 0

    def allocate(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of ``shape`` and ``dtype`` backed by the file."""
        if self.file is None:
            raise RuntimeError("confkv: the page file is closed")
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        offset = -(-self.file_bytes // _ALIGN) * _ALIGN
        os.ftruncate(self.file.fileno(), offset + max(nbytes, 1))
        self.file_bytes = offset + max(nbytes, 1)
        self.live_bytes += nbytes
        if nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        mapped = np.memmap(self.file, dtype=np.uint8, mode="r+", offset=offset, shape=(nbytes,))
        return torch.from_numpy(mapped).view(dtype).reshape(shape)

    def release(self, tensor: torch.Tensor) -> None:
        """Forget ``tensor`` (its bytes stay in the file until :meth:`close`)."""
        self.live_bytes -= tensor.nbytes

    def __deepcopy__(self, memo: dict) -> "PageFile":
        """Copies share the file (an open file cannot be copied); a deep-copied cache's existing
        pages are copied into RAM, its new pages go to this file."""
        return self

    def close(self) -> None:
        """Close the file; its space returns to the system once no tensor maps it."""
        if self.file is not None:
            self.file.close()
            self.file = None
