"""The versioned Xid data table (code -> name, fatal) and the classification of one Xid event.

Source: NVIDIA's Xid catalog for Ampere and newer GPUs ("Analyzing Xid Errors with the Xid Catalog",
https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html , page revision of 2026-09), its
"Resolution Bucket (Immediate Action)" column. `fatal` here means that immediate action goes beyond
restarting the application (RESET_GPU, RESTART_BM, the reset-or-reboot workflows of Xid 48 and 74,
CONTACT_SUPPORT for codes the catalog marks unused), so a run that saw one cannot vouch for the machine.
Codes whose immediate action is RESTART_APP or IGNORE are not fatal. A code not in the table fails closed.
Bump XID_TABLE_VERSION whenever a row changes: every receipt records the version it was judged by.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import NamedTuple

# 2026.09-2 (from 2025.11-1): 109 (CTXSW timeout) is RESET_GPU in the catalog, so fatal; rows added for the
# RESET_GPU codes 46, 110, 136, 155, 156, 158 and the RESTART_APP/IGNORE codes 11, 14, 25, 37-41, 44, 60, 66,
# 67, 80, 93, 106-108, 137, 141, 157 (unknown codes fail closed, so missing benign rows rejected good runs);
# 154 follows the recovery action it announces (a change to None is not fatal).
XID_TABLE_VERSION = "2026.09-2"
XID_TABLE_SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"


class XidInfo(NamedTuple):
    name: str
    fatal: bool


# One row per code: the catalog's description, and whether its immediate action is beyond RESTART_APP.
# Keep it data: the policy below only reads `fatal` (154 alone also reads its message).
XID_TABLE: dict[int, XidInfo] = {
    8: XidInfo("GPU stopped processing (channel idle timeout)", False),  # RESTART_APP
    11: XidInfo("Invalid or corrupted push buffer stream (missing hardware)", False),  # RESTART_APP
    13: XidInfo("Graphics Engine Exception", False),  # RESTART_APP
    14: XidInfo("Fake error (test)", False),  # IGNORE
    25: XidInfo("Illegal notify", False),  # RESTART_APP
    31: XidInfo("GPU memory page fault", False),  # RESTART_APP
    32: XidInfo("Invalid or corrupted push buffer stream (PBDMA)", False),  # RESTART_APP
    37: XidInfo("FECS unimplemented firmware method", False),  # IGNORE
    38: XidInfo("FECS watchdog timeout", False),  # IGNORE
    39: XidInfo("Copy Engine 0 exception", False),  # RESTART_APP
    40: XidInfo("Copy Engine 1 exception", False),  # RESTART_APP
    41: XidInfo("Copy Engine 2 exception", False),  # RESTART_APP
    43: XidInfo("GPU stopped processing", False),  # IGNORE
    44: XidInfo("Graphics engine fault during context switch", False),  # IGNORE
    45: XidInfo("Preemptive cleanup, due to previous errors", False),  # WORKFLOW_XID_45: follows other Xids
    46: XidInfo("GPU stopped processing (GPU timeout)", True),  # RESET_GPU
    48: XidInfo("Double Bit ECC Error", True),  # WORKFLOW_XID_48: reset GPU or reboot
    60: XidInfo("SEC2 engine error", False),  # RESTART_APP
    61: XidInfo("Internal micro-controller breakpoint/warning (unused on Ampere+)", True),  # CONTACT_SUPPORT
    62: XidInfo("Internal micro-controller halt", True),  # RESET_GPU
    63: XidInfo("GPU memory remapping event (ECC page retirement / row remapping)", False),  # IGNORE
    64: XidInfo("GPU memory remapping failure", True),  # RESET_GPU
    66: XidInfo("FECS register access violation", False),  # IGNORE
    67: XidInfo("FECS verification violation", False),  # IGNORE
    68: XidInfo("NVDEC0 Exception", False),  # RESTART_APP
    69: XidInfo("Graphics Engine class error", False),  # RESTART_APP
    74: XidInfo("NVLINK Error", True),  # WORKFLOW_NVLINK_ERR: reset GPU or reboot
    79: XidInfo("GPU has fallen off the bus", True),  # RESTART_BM
    80: XidInfo("Push buffer CRC mismatch", False),  # RESTART_APP
    92: XidInfo("High single-bit ECC error rate", False),  # IGNORE
    93: XidInfo("Non-fatal violation of provisioned InfoROM wear limit", False),  # IGNORE
    94: XidInfo("Contained ECC error", False),  # RESTART_APP
    95: XidInfo("Uncontained ECC error", True),  # RESET_GPU
    106: XidInfo("SMBPBI test message", False),  # IGNORE
    107: XidInfo("SMBPBI test message (silent)", False),  # IGNORE
    108: XidInfo("NVLink remote translation error", False),  # IGNORE
    109: XidInfo("Context Switch Timeout Error", True),  # RESET_GPU
    110: XidInfo("Security fault error", True),  # RESET_GPU
    119: XidInfo("GSP RPC Timeout", True),  # RESET_GPU
    120: XidInfo("GSP Error", True),  # RESET_GPU
    121: XidInfo("C2C Link corrected error", False),  # IGNORE
    136: XidInfo("NVLink ALI training failure", True),  # RESET_GPU
    137: XidInfo("NVLink privilege error", False),  # IGNORE
    140: XidInfo("Unrecovered ECC Error", True),  # RESET_GPU
    141: XidInfo("Fast path error", False),  # IGNORE
    143: XidInfo("GPU Initialization Failure", True),  # RESET_GPU
    154: XidInfo("GPU Recovery Action Changed", True),  # XID_154: fatal unless the new action is None
    155: XidInfo("NVLink software-defined error", True),  # RESET_GPU
    156: XidInfo("Resource retirement event", True),  # RESET_GPU
    157: XidInfo("Resource retirement failure", False),  # IGNORE
    158: XidInfo("GPU fatal timeout", True),  # RESET_GPU
}

# Xid 154 summarises the recovery action other Xids need: "... changed from 0x0 (None) to 0x2 (Node Reboot
# Required)". Only a change *to* None says that no recovery is needed.
_RECOVERY_TO_NONE = re.compile(r"\bto\s+0x0+\s*\(None\)", re.IGNORECASE)


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
    fatal = info.fatal
    if code == 154 and _RECOVERY_TO_NONE.search(message or line or ""):
        fatal = False
    return XidEvent(code, info.name, fatal, True, source, device, message, line)


def table_evidence() -> dict:
    """What a receipt records about the table it was judged by."""
    return {
        "version": XID_TABLE_VERSION,
        "source": XID_TABLE_SOURCE,
        "fatal_codes": sorted(c for c, i in XID_TABLE.items() if i.fatal),
    }
