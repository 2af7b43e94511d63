"""Reading config files safely: a size cap, an alias-expansion cap, duplicate keys refused, short messages.

YAML aliases can make a few hundred bytes expand into billions of nodes ("billion laughs"); the composed node graph
is measured (with aliases counted as often as they are used, memoised so measuring is linear in the file) before
anything is constructed from it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ._validation import short
from .errors import ConfigError

MAX_NODES = 100_000
"""Most YAML nodes a config may expand to (a real merge config has well under a thousand)."""


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-4`` as a float (YAML 1.1 reads it as a string) and refuses duplicate keys."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the parent class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {short(key, 40)}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                   |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                   |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.VERBOSE),
    list("-+0123456789."),
)


def load_yaml(path: Path, *, max_bytes: int, needs: str = "`base` and `models`") -> Any:
    """Parse a YAML file into Python objects, refusing files that are missing, too big or expand too much.

    Raises:
        ConfigError: with a message of at most a few hundred characters.
    """
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} is not a file.")
        if size > max_bytes:
            raise ConfigError(f"Config file {str(path)!r} is {size} bytes; merge configs are small (limit "
                              f"{max_bytes} bytes). Is this the right file?")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"Config file {str(path)!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"Cannot read config file {str(path)!r}: {short(str(err), 200)}") from None
    return parse_yaml(text, where=f"Config file {str(path)!r}", needs=needs)


def parse_yaml(text: str, *, where: str = "The config", needs: str = "`base` and `models`") -> Any:
    """Parse YAML text with the checks of :func:`load_yaml` (except the size, which the caller knows); ``needs``:
    the keys an empty file is told it lacks."""
    loader = None
    try:
        loader = ConfigLoader(text)  # its reader refuses control characters already
        node = loader.get_single_node()
        if node is None:
            raise ConfigError(f"{where} is empty; it needs at least {needs}.")
        size = _expanded_size(node, {}, 0)
        if size > MAX_NODES:
            raise ConfigError(f"{where} expands to more than {MAX_NODES} YAML nodes (nested aliases?); refusing "
                              "to read it.")
        return loader.construct_document(node)
    except yaml.YAMLError as err:  # what and where, never the file's lines (a wrong file may hold a secret)
        problem = getattr(err, "problem", None) or getattr(err, "context", None) or type(err).__name__
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        if isinstance(err, yaml.reader.ReaderError):  # a character YAML does not allow, e.g. a stray NUL or BEL
            code = ord(err.character) if isinstance(err.character, str) else int(err.character)
            problem, at = f"unacceptable character #x{code:04x}", f" (position {err.position})"
        message = " ".join(f"{problem}{at}".split())
        message = message if len(message) <= 300 else message[:297] + "..."
        raise ConfigError(f"{where} is not valid YAML: {message}") from None
    except RecursionError:
        raise ConfigError(f"{where} is nested too deeply (or has a recursive alias).") from None
    finally:
        if loader is not None:
            loader.dispose()


def _expanded_size(node: yaml.Node, memo: dict[int, int], depth: int) -> int:
    """Number of nodes after alias expansion (aliases share node objects; memoised by identity)."""
    if id(node) in memo:
        return memo[id(node)]
    if depth > 100:
        raise RecursionError
    memo[id(node)] = MAX_NODES + 1  # a cycle through an alias counts as "too big"
    total = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            total += _expanded_size(child, memo, depth + 1)
            if total > MAX_NODES:
                break
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            total += _expanded_size(key, memo, depth + 1) + _expanded_size(value, memo, depth + 1)
            if total > MAX_NODES:
                break
    memo[id(node)] = total
    return total
