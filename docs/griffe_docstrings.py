"""Griffe extension for the docs build: reads docstrings as the test suite's doctests do.

Two habits of jaxext's docstrings that plain Google style lacks are rewritten before
mkdocstrings parses them:

- Sphinx roles (``:func:`jaxext.linear```) become autorefs links,
  ``[`jaxext.linear`][jaxext.linear]``; a name without dots is looked up in the
  docstring's own module. A target that exists nowhere in the site fails the strict
  build, as any broken cross-reference does. A role naming another library's object
  (``:func:`jax.custom_vjp```) becomes code, which docs/hooks.py links to its docs.
- An ``Args:`` entry naming several arguments at once (``eps, atol, rtol: as for
  gradcheck.``) becomes one entry per argument with the same description.
- ``Example:`` (the house style's heading for the doctest run by the suite) is read as
  Google style's ``Examples:`` section, whose ``>>>`` lines render as code with their
  output; as a plain admonition, Markdown would read ``>>>`` as nested quotes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|exc|data|obj):`~?([\w.]+)`")
_SECTION = re.compile(r"^(Args|Arguments|Parameters):\n((?:[ \t]+.*\n?|\n)+)", re.MULTILINE)
_GROUPED_ENTRY = re.compile(
    r"^(?P<indent>[ \t]+)(?P<names>\w+(?:,\s+\w+)+):(?P<text>.*(?:\n(?P=indent)[ \t]+.*)*)",
    re.MULTILINE,
)
_EXAMPLE_HEADING = re.compile(r"^Example:[ \t]*$", re.MULTILINE)
# Roles naming these libraries' objects (``:func:`jax.custom_vjp```) become code, not autorefs
# links: their inventories are not in the offline build.
_OTHER_LIBRARIES = {"jax", "flax", "nnx", "numpy", "np", "jnp", "torch", "optax"}


def _split_grouped_entries(section: re.Match[str]) -> str:
    def split(entry: re.Match[str]) -> str:
        names = re.split(r",\s+", entry["names"])
        return "\n".join(f"{entry['indent']}{name}:{entry['text']}" for name in names)

    return f"{section[1]}:\n" + _GROUPED_ENTRY.sub(split, section[2])


class DocstringHabits(griffe.Extension):
    """Rewrites roles and grouped ``Args:`` entries in every docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return

        def link(match: re.Match[str]) -> str:
            target = match.group(1)
            if target.split(".")[0] in _OTHER_LIBRARIES:
                return f"`{target}`"  # linked to that library's docs by docs/hooks.py
            if "." not in target and target in obj.module.members:
                return f"[`{target}`][{obj.module.path}.{target}]"
            return f"[`{target}`][{target}]"

        text = _ROLE.sub(link, obj.docstring.value)
        text = _SECTION.sub(_split_grouped_entries, text)
        obj.docstring.value = _EXAMPLE_HEADING.sub("Examples:", text)
