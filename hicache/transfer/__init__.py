"""Page transfers between the device pool and the host pool."""

from hicache.transfer.engine import TransferEngine

__all__ = ["TransferEngine"]
