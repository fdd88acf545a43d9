"""The tinker SDK this backend is built for, and the API key it talks with: the pinned
version checked before anything is imported, the key read only from $TINKER_API_KEY and
scrubbed from every message."""

from __future__ import annotations

import importlib.metadata
import os

from retrain.errors import UserError

TINKER_VERSION = "0.38.0"
KEY_ENV = "TINKER_API_KEY"


def check_sdk() -> None:
    """Fail early, and clearly, when the SDK is missing or not the pinned version."""
    try:
        installed = importlib.metadata.version("tinker")
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"backend = 'tinker' needs the tinker SDK: pip install "
                        f"'retrain[tinker]' (tinker=={TINKER_VERSION})") from None
    if installed != TINKER_VERSION:
        raise UserError(f"backend = 'tinker' is built and tested against tinker=="
                        f"{TINKER_VERSION}, but {installed} is installed; run pip install "
                        f"'tinker=={TINKER_VERSION}' (the wire protocol changes between "
                        "versions)")


class Secret:
    """Holds the API key only to scrub it from messages; never prints it."""

    def __init__(self, value: str):
        self._value = value

    def scrub(self, text: str) -> str:
        return text.replace(self._value, "***") if self._value else text

    def __repr__(self) -> str:
        return "Secret(***)"


def api_key() -> Secret:
    """The key from the environment (never from config files), or a UserError saying so."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise UserError(f"backend = 'tinker' needs ${KEY_ENV} in the environment (the key "
                        "is never read from config files)")
    return Secret(key)
