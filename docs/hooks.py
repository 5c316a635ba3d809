"""Build hooks of the docs site (mkdocs.yml's ``hooks``).

The project's docstrings name other objects the Sphinx way (:func:`x`, :mod:`x`); mkdocstrings
renders them as text, so a role would show as ``:func:`` before the name. The role is dropped
and the name stays as code.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub("", html)
