"""Measured cost tables for ``split="auto"``: the table (``table``), and the command that measures
one on this machine (``python -m weavepass.tune``, ``command``). Importing this package imports
neither torch's compiler nor any lowering."""
