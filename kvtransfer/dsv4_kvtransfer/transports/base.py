"""The transport interface: how a pull's bytes get from the remote staging region into ours.

Every transport shares the control path (an authenticated frame connection: manifest, release);
they differ in the data path: TCP frames, a same-host memcpy, a collective send/recv, RDMA reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from dsv4_kvtransfer.pd_protocol import RemotePrefillParams
from dsv4_kvtransfer.peer import PeerConnection
from dsv4_kvtransfer.staging import Trailer


class TransportUnavailable(RuntimeError):
    """This transport cannot run here (missing library or device); the message says what."""


class TransferFailed(RuntimeError):
    """The data path failed; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class FetchJob:
    control: PeerConnection
    """Authenticated connection to the remote sidecar (the manifest was read on it)."""
    connect: Callable[[], PeerConnection]
    """Opens another authenticated connection to the same sidecar (parallel streams)."""
    transfer_id: str
    dest: memoryview
    """Our staging extent for the transfer, ``total_bytes`` long."""
    progress: Callable[[int], None]
    """Called with the number of bytes that just landed."""
    deadline: float
    """``time.monotonic()`` after which the pull is abandoned."""
    requested: bool = False
    """The transport's ``pipelined_request`` went out behind the manifest request: ``fetch``
    reads its reply instead of asking."""


class DirectSource(ABC):
    """An export this sidecar can read in place (same host): its trailer, and its bytes."""

    @abstractmethod
    def trailer(self) -> Trailer | None:
        """The export's trailer if it is live now (None: not pullable this way)."""

    @abstractmethod
    def copy_into(self, dest: memoryview, deadline: float) -> None:
        """Copy the export's bytes (``len(dest)`` of them) into ``dest``."""


class Transport(ABC):
    name: str = ""

    def check_available(self) -> None:  # noqa: B027  (most transports need nothing)
        """Raise ``TransportUnavailable`` with a clear message if this transport cannot run."""

    def pipelined_request(self, conn: PeerConnection, transfer_id: str, total_bytes: int) -> bytes:
        """The frames that start this transport's data path for a pull of ``total_bytes`` (the
        params' size; the manifest is checked against it before any byte lands), sent in one
        write with the manifest request so the pull takes one round trip fewer; ``b""``: none,
        ``fetch`` asks itself."""
        return b""

    def direct_source(self, params: RemotePrefillParams) -> DirectSource | None:
        """The export the params name, readable in place without asking its sidecar first
        (``None``: ask it, the usual way)."""
        return None

    @abstractmethod
    def fetch(self, job: FetchJob) -> None:
        """Land every byte of the remote export in ``job.dest``, or raise."""

    def close(self) -> None:  # noqa: B027
        """Release what the transport holds (mappings, process groups)."""
