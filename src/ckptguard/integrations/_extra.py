"""One clear error for an integration imported without its framework installed.

Without it, ``import ckptguard.integrations.hf`` in an environment lacking transformers fails deep in an
import chain (``ModuleNotFoundError``, or "'transformers' is not a package"), naming neither the
integration nor the line that fixes it. Each integration wraps its framework imports::

    try:
        from transformers import Trainer
    except ImportError as e:
        raise missing_extra("hf", "transformers", e) from e
"""

from __future__ import annotations


def missing_extra(integration: str, extra: str, cause: ImportError) -> ImportError:
    """The ``ImportError`` naming the integration, what failed to import and ``pip install 'ckptguard[<extra>]'``."""
    return ImportError(
        f"ckptguard.integrations.{integration} needs the {extra} framework, which is not installed or cannot be "
        f"imported ({cause}); install it with: pip install 'ckptguard[{extra}]'",
        name=cause.name,
    )
