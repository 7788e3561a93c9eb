"""Griffe extensions of the docs site.

* ``RstToMarkdown``: llmdd's docstrings use a few reStructuredText constructs (roles such as
  :class:`X`, a paragraph ending in ``::`` before a literal block, ``.. versionadded::``) that
  Markdown would show raw. Before mkdocstrings renders a docstring, they become their Markdown
  equivalents: a role becomes inline code, ``::`` a colon (the indented block after it stays a
  code block), ``.. versionadded:: V`` an italic line.
* ``EnumValues``: griffe reads the source, so an enumeration member shows the expression it
  was written with (``_BASE + 5``); this shows the member's value instead, read from the
  imported class (left as written when the module cannot be imported).

Configured in mkdocs.yml (``extensions`` of the python handler); a local file, nothing fetched.
"""

from __future__ import annotations

import enum
import importlib
import re
from typing import Any

from griffe import Extension

_ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const|ref):`~?\.?([^`]+)`")
_VERSION = re.compile(r"^(?P<indent>[ \t]*)\.\. version(?P<what>added|changed)::[ \t]*(?P<v>\S+)[ \t]*$", re.M)
_LITERAL = re.compile(r"(?<=\S)::[ \t]*$", re.M)


def to_markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText roles, literal markers and version notes
    rewritten as Markdown."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = _VERSION.sub(lambda m: f"{m.group('indent')}*{'New' if m.group('what') == 'added' else 'Changed'}"
                                  f" in version {m.group('v')}.*", text)
    return _LITERAL.sub(":", text)


class RstToMarkdown(Extension):
    """Rewrites every loaded object's docstring with :func:`to_markdown`."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and docstring.value:
            docstring.value = to_markdown(docstring.value)


class EnumValues(Extension):
    """Sets each enumeration member's shown value to its runtime value."""

    def on_attribute_instance(self, *, attr: Any, **kwargs: Any) -> None:
        parent = attr.parent
        if parent is None or not getattr(parent, "is_class", False):
            return
        try:
            cls = getattr(importlib.import_module(parent.module.path), parent.name)
        except Exception:  # noqa: BLE001 - not importable here: keep the source expression
            return
        if isinstance(cls, type) and issubclass(cls, enum.Enum) and attr.name in cls.__members__:
            attr.value = repr(cls.__members__[attr.name].value)
