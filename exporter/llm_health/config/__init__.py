"""Configuration: shared field validators (`fields`) and one typed schema per product,
each parsed once. Every error names the file and the dotted key (`ConfigError`)."""
