"""Run configs (tools layer): the one loader for every config kind (`run.load_any`), the schema
helpers, the cross-checks and the generated docs/configuration.md."""
