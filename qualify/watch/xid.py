"""The versioned Xid data table (code -> name, fatal) and the classification of one Xid event.

Source: NVIDIA's Xid catalog ("Analyzing Xid Errors with the Xid Catalog", Ampere and newer GPUs):
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html . `fatal` here means the catalog's
immediate action goes beyond restarting the application (reset the GPU, reboot, drain/RMA), so a run that
saw one cannot vouch for the machine. Codes whose immediate action is RESTART_APP or IGNORE are not fatal.
Bump XID_TABLE_VERSION whenever a row changes: every receipt records the version it was judged by.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

XID_TABLE_VERSION = "2025.11-1"
XID_TABLE_SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


class XidInfo(NamedTuple):
    name: str
    fatal: bool


# One row per code. Keep it data: the policy below only reads `fatal`.
XID_TABLE: dict[int, XidInfo] = {
    8: XidInfo("GPU stopped processing (channel idle timeout)", False),
    13: XidInfo("Graphics Engine Exception", False),
    31: XidInfo("GPU memory page fault", False),
    32: XidInfo("Invalid or corrupted push buffer stream", False),
    43: XidInfo("GPU stopped processing", False),
    45: XidInfo("Preemptive cleanup, due to previous errors", False),
    48: XidInfo("Double Bit ECC Error", True),
    61: XidInfo("Internal micro-controller breakpoint/warning", True),
    62: XidInfo("Internal micro-controller halt", True),
    63: XidInfo("ECC page retirement or row remapping recording event", False),
    64: XidInfo("ECC page retirement or row remapper recording failure", True),
    68: XidInfo("NVDEC0 Exception", False),
    69: XidInfo("Graphics Engine class error", False),
    74: XidInfo("NVLINK Error", True),
    79: XidInfo("GPU has fallen off the bus", True),
    92: XidInfo("High single-bit ECC error rate", False),
    94: XidInfo("Contained ECC error", False),
    95: XidInfo("Uncontained ECC error", True),
    109: XidInfo("Context Switch Timeout Error", False),
    119: XidInfo("GSP RPC Timeout", True),
    120: XidInfo("GSP Error", True),
    121: XidInfo("C2C Link corrected error", False),
    140: XidInfo("Unrecovered ECC Error", True),
    143: XidInfo("GPU Initialization Failure", True),
    154: XidInfo("GPU Recovery Action Changed (reset or reboot required)", True),
}


@dataclass(frozen=True)
class XidEvent:
    """One Xid seen during a run, already classified."""

    code: int
    name: str
    fatal: bool
    known: bool  # False: the code is not in the table; it is then treated as fatal (fail closed)
    source: str  # "kmsg" or "nvml"
    device: str | None  # PCI bus id where the source gives one
    message: str
    line: str | None = None  # the kernel-log line as read, when the source is a log
    seen_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def to_evidence(self) -> dict:
        out = asdict(self)
        out["seen_at"] = self.seen_at.isoformat()
        return out


def classify(
    code: int, source: str, device: str | None = None, message: str = "", line: str | None = None
) -> XidEvent:
    """Classify an Xid code by the table; an unknown code fails closed (fatal) and says so."""
    info = XID_TABLE.get(code)
    if info is None:
        name = f"unknown Xid {code} (not in table {XID_TABLE_VERSION})"
        return XidEvent(code, name, True, False, source, device, message, line)
    return XidEvent(code, info.name, info.fatal, True, source, device, message, line)


def table_evidence() -> dict:
    """What a receipt records about the table it was judged by."""
    return {
        "version": XID_TABLE_VERSION,
        "source": XID_TABLE_SOURCE,
        "fatal_codes": sorted(c for c, i in XID_TABLE.items() if i.fatal),
    }
