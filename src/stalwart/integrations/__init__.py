"""Integrations with the frameworks that own the training loop.

Each module imports its framework and is imported only by the scripts that use it
(``from stalwart.integrations.transformers import StalwartCallback``): importing
``stalwart.integrations`` itself imports nothing. The frameworks are optional extras
(``pip install 'stalwart[hf]'``); docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []
