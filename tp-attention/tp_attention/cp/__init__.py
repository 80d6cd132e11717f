"""The context-parallel study (`python -m tp_attention.cp`): `study` (validate, the app), `bench`
(the rank function), `parity` (ring and all-to-all against one device), `report` (finalize)."""
