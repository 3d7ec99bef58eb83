"""cpbook's cost model (moved from ``cpbook/costmodel.py``; the split into modules follows)."""

from .specs import *  # noqa: F401,F403
from .specs import _decode_config, _gqa, _mla  # noqa: F401
