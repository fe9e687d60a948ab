"""The shared file behind an address of this process (/proc/self/maps): how an engine that
allocated its KV memory in a memfd or a /dev/shm file finds the fd to send the sidecar."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MappedFile:
    """fd: a new descriptor of the file (the caller closes it); offset: where the address lies
    in the file; size: the file's size in bytes."""

    fd: int
    offset: int
    size: int


def shared_file_of(address: int) -> MappedFile:
    """The file that backs `address` in a shared mapping. Raises ValueError for an address in
    no mapping, in private or anonymous memory (torch's own allocations), or in a file this
    process has neither open nor reachable by path."""
    for line in _maps():
        span, perms, offset, dev, inode, *path = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if not start <= address < end:
            continue
        if "s" not in perms or inode == "0":
            raise ValueError(
                f"address {address:#x} is in private memory ({perms} {' '.join(path) or 'anonymous'}): "
                "allocate the KV memory in a memfd or /dev/shm so that the sidecar can map it"
            )
        major, minor = (int(x, 16) for x in dev.split(":"))
        fd = _open_fd_of(os.makedev(major, minor), int(inode), path[0].strip() if path else "")
        return MappedFile(fd, address - start + int(offset, 16), os.fstat(fd).st_size)
    raise ValueError(f"address {address:#x} is in no mapping of this process")


def _maps() -> list[str]:
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


def _open_fd_of(dev: int, inode: int, path: str) -> int:
    """A new fd of the file (dev, inode): a dup of one this process holds open (a memfd has no
    path), else the file opened by path."""
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue  # closed meanwhile, or the listing's own fd
        if st.st_ino == inode and st.st_dev == dev:
            return os.dup(int(name))
    if path.startswith("/") and not path.endswith("(deleted)"):
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        st = os.fstat(fd)
        if st.st_ino == inode and st.st_dev == dev:
            return fd
        os.close(fd)
    raise ValueError(f"the shared file {path or '(memfd)'} behind this memory is not open in this process")
