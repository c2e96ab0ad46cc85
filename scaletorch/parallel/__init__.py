"""One module per strategy; each converts the reference model in place (see doc/design.md)."""
