"""The configuration: the typed schema (`schema`, `base`, `stages`), reading and composing YAML
(`yaml_reader`, `compose`, `loader`), the checks (`checks`, `path_checks`, `trl_args`) and the generated
reference (`reference`). The schema modules import pydantic and the family table only."""
