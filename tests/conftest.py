"""What the test files under tests/ share with test_d3d.py: its tokenizer and its tiny target, as
fixtures (pytest finds a conftest's fixtures by name, imported ones too)."""

from test_d3d import target, tok  # noqa: F401
