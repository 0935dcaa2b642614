"""What each XID code means (NVIDIA's XID catalog) and which ones call for an operator now."""

from __future__ import annotations

XID_MEANINGS: dict[int, str] = {
    8: "GPU stopped processing (timeout)",
    13: "graphics engine exception (illegal address, out-of-range access: usually the application)",
    31: "GPU memory page fault (usually an application bug)",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing (reset channel; user application fault)",
    45: "preemptive cleanup after a fatal error (process killed)",
    48: "double-bit ECC error (uncorrectable memory error)",
    56: "display engine error",
    57: "error programming video memory interface",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failure",
    68: "NVDEC0 exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (application affected)",
    95: "uncontained ECC error (GPU reset required)",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
}
XID_CRITICAL = frozenset((48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 121, 140))
