"""Loading a config (`loader.load_config`: compose, override, validate) and the checks that need the packages
above the configuration's floor: reward names and model rewards' kwargs, sampling strategies and a source's
columns, importing module:function rewards, TRL's argument classes (`rules`), and the paths a config names
(`config_paths`, over the generic predicates of `vlmexp.paths`). `vlmexp.config` holds the schema these
check; nothing below this package imports it."""
