"""Exporting a tinker:// checkpoint: the weights through the SDK, as `tinker checkpoint
download` fetches them (the training state loaded into a session, saved as external weights,
downloaded from the signed URLs the service gives, the temporary export deleted). A service
that does not offer downloads (`retrain serve` does not) is a clear error."""

from __future__ import annotations

import contextlib
import urllib.request
from pathlib import Path

from retrain.config.sections import Config
from retrain.errors import UserError
from retrain.results.run_checkpoint import Checkpoint

EXPORT_TTL_S = 3600


def download(cfg: Config, ckpt: Checkpoint, folder: Path) -> None:
    """Fetch the weights of `ckpt` into the (empty, existing) `folder`."""
    from retrain.backends.tinker.sdk import KEY_ENV, check_sdk

    check_sdk()
    import os

    if not os.environ.get(KEY_ENV):
        raise UserError(f"exporting a tinker checkpoint needs ${KEY_ENV} in the environment")
    import tinker

    base_url = cfg.backend.base_url or os.environ.get("TINKER_BASE_URL") or None
    service = tinker.ServiceClient(base_url=base_url)
    try:
        training = service.create_training_client_from_state(ckpt.ref).result()
        export = training.save_weights_external("retrain-export",
                                                ttl_seconds=EXPORT_TTL_S).result().path
    except Exception as exc:  # the SDK's errors: not offered, not found, no network
        raise UserError(_not_offered(ckpt, exc)) from None
    finally:  # the session ends here, not at its heartbeat's timeout on the service
        with contextlib.suppress(Exception):
            service.close("success").result(timeout=30)
    rest = tinker.RestClient(base_url=base_url)
    try:
        urls = rest.get_external_weights_urls(export).result().urls
        for name, url in sorted(urls.items()):
            dest = (folder / name).resolve()
            if not dest.is_relative_to(folder.resolve()):
                raise UserError(f"the service named an unsafe file {name!r} in {ckpt.ref}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as fh:
                while chunk := response.read(1 << 20):
                    fh.write(chunk)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(_not_offered(ckpt, exc)) from None
    finally:
        with contextlib.suppress(Exception):
            rest.delete_checkpoint_from_tinker_path(export).result()


def _not_offered(ckpt: Checkpoint, exc: BaseException) -> str:
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"step {ckpt.step} is a tinker checkpoint ({ckpt.ref}) and the service did not "
            f"hand out its weights ({type(exc).__name__}: {why}); fetch them with the tinker "
            f"CLI where the service offers downloads (`tinker checkpoint download {ckpt.ref}`)"
            ", or train with backend = 'local' to export")
