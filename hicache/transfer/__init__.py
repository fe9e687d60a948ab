"""Page transfers between the device pool and the host pool.

The engine (torch) loads when first named; native, plan and progress do not need torch."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.transfer.engine import TransferEngine
    from hicache.transfer.handles import TransferHandle

__all__ = ["TransferEngine", "TransferHandle"]


def __getattr__(name: str) -> object:
    if name == "TransferEngine":
        from hicache.transfer.engine import TransferEngine

        return TransferEngine
    if name == "TransferHandle":
        from hicache.transfer.handles import TransferHandle

        return TransferHandle
    raise AttributeError(f"module 'hicache.transfer' has no attribute {name!r}")
