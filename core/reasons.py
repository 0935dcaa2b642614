"""The snapshot contract's shared vocabulary: NVML clocks-event (throttle) reason bits, defined once."""

from __future__ import annotations

from enum import IntFlag


class ThrottleReason(IntFlag):
    """NVML clocks-event (throttle) reason bits, as nvmlDeviceGetCurrentClocksEventReasons reports them."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100

    @property
    def label(self) -> str:
        """Lower-case name used as a Prometheus label value."""
        return (self.name or "").lower()


THERMAL_REASONS = ThrottleReason.SW_THERMAL_SLOWDOWN | ThrottleReason.HW_THERMAL_SLOWDOWN
CLOCK_CUT_REASONS = (
    ThrottleReason.HW_SLOWDOWN | ThrottleReason.HW_THERMAL_SLOWDOWN | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN
)
