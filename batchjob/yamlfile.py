"""Reading the YAML files users write (job configs, nightly definitions), stricter than `yaml.safe_load`.

Two things PyYAML lets slide would cost a night. A key written twice in one mapping keeps only the last
value, so a second `loader:` section silently resets `num_frames`; and a binary file dropped where the
config belongs raises UnicodeDecodeError from deep inside the reader. Both become a `YamlFileError`
naming the file (and the line), which the callers turn into their exit-2 config errors.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class YamlFileError(ValueError):
    """The file is not a YAML text file we accept; the message names it and says what is wrong."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated within one mapping (`<<` merges may still override)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            first = seen.get(key)
        except TypeError:          # an unhashable key: the base constructor says so
            continue
        if first is not None:
            raise YamlFileError(f"line {line}: key {key!r} appears twice in one mapping (first on line {first}); "
                                "YAML would keep only the last one: remove or merge one of them")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def parse_yaml(text: str) -> Any:
    """A YAML document, duplicate keys refused (YamlFileError without a file name)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)


def read_yaml(path: Path, what: str) -> Any:
    """The parsed document of the YAML file at `path`; `what` names the kind of file in messages."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise YamlFileError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise YamlFileError(f"{path}: not a text file (bytes that are not UTF-8 at offset {err.start}); a {what} "
                            "is a YAML text file: check the path") from None
    try:
        return parse_yaml(text)
    except YamlFileError as err:
        raise YamlFileError(f"{path}: {err}") from None
    except yaml.YAMLError as err:
        raise YamlFileError(f"{path}: not valid YAML: {err}") from None
