"""`[campaign] ray_address` (and $RAY_ADDRESS): its forms, checked before Ray sees it.

Ray answers a malformed address or an unknown scheme with a long traceback. Here the text is
parsed when the config is loaded (a problem is one line naming the forms expected); the
probe of whether it answers is `slots_ray`'s. Pure: no Ray, no network.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

KEYWORDS = ("", "auto")  # $RAY_ADDRESS, else the cluster running on this machine
FORMS = "host:port (a `ray start` head, e.g. 10.0.0.1:6379) or ray://host:port (Ray Client)"


@dataclass(frozen=True)
class RayAddress:
    """A cluster address: `scheme` is "" for a head's GCS (host:port), "ray" for Ray Client."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme + '://' if self.scheme else ''}{host}:{self.port}"


def parse(text: str) -> RayAddress | None:
    """The address `text` names (None for the keywords "" and "auto"); ValueError says what is
    wrong with it."""
    text = text.strip()
    if text in KEYWORDS:
        return None
    scheme, sep, _ = text.partition("://")
    if sep and scheme != "ray":
        raise ValueError(f"unknown scheme {scheme + '://'!r} in {text!r}; use {FORMS}")
    try:
        parts = urlsplit(text if sep else f"//{text}")
        port = parts.port
    except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
        raise ValueError(f"{text!r} is not a valid address ({exc}); use {FORMS}") from None
    if not parts.hostname or port is None or port == 0 or parts.path or parts.query:
        raise ValueError(f"{text!r} is not a valid address; use {FORMS}")
    return RayAddress("ray" if sep else "", parts.hostname, port)


def problem(text: str) -> str | None:
    """What is wrong with `text` as an address, or None."""
    try:
        parse(text)
    except ValueError as exc:
        return str(exc)
    return None
