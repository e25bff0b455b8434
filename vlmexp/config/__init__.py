"""The configuration's ground floor: the typed schema (`schema`, `base`, `stages`), reading and composing YAML
(`yaml_reader`, `compose`), TRL's argument classes (`trl_args`) and the generated reference (`reference`). It
imports pydantic, the family table and `vlmexp.errors` only, never the data or reward packages above it:
loading a config with the checks that need them (reward names, data sources, paths) is `vlmexp.checks`."""
