"""Device plugins (CPU, CUDA, simulated from a spec, third-party ones) found through the `xsched.devices` entry points."""

from xsched.devices.base import (
    ENTRY_POINT_GROUP,
    Device,
    DeviceError,
    DeviceInfoRow,
    Measurement,
    Policy,
    available_devices,
    fit_link,
    get_device,
    installed_kinds,
    plugin,
    plugins,
    split_device_list,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Device",
    "DeviceError",
    "DeviceInfoRow",
    "Measurement",
    "Policy",
    "available_devices",
    "fit_link",
    "get_device",
    "installed_kinds",
    "plugin",
    "plugins",
    "split_device_list",
]
