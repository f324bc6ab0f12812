"""Profiles: the contract (`contract`), measuring through the device plugins (`measure`), the store under
profiles/ with its one validating loader (`store`), and the modelled profile (`model`).

The package itself exports the contract only, so the device plugins (which describe themselves with
`DeviceInfo`) can import it without importing the measuring loop that uses them.
"""

from xsched.profile.contract import SCHEMA, DeviceInfo, LinkCost, OpCost, Profile, validate_profile

__all__ = ["SCHEMA", "DeviceInfo", "LinkCost", "OpCost", "Profile", "validate_profile"]
