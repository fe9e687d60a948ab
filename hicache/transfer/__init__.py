"""Page transfers between the device pool and the host pool."""

from hicache.transfer.engine import TransferEngine
from hicache.transfer.handles import TransferHandle

__all__ = ["TransferEngine", "TransferHandle"]
