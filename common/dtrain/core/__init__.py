"""The torch-free base vocabulary every layer imports: `errors` (UserError, `fail`), `checks`
(impossible values), `files`, `diskfull`, `terminal` (console, progress bars), `layout` (the one
Layout type) and `nodes` (the typed Hydra config nodes)."""
