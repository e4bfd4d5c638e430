"""The built-in per-example rules, one file a layer family; each registers its rules on import."""
